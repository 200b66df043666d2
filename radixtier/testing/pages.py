"""Deterministic page contents: a page's bytes derived from its key, so any read is checked
without a side table (also in subprocesses, which import this by name)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def page_content(key: bytes, numel: int) -> torch.Tensor:
    """Page bytes derived from the page key, so any read can be checked without a side table."""
    raw = hashlib.shake_256(key).digest(numel * 4)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())
