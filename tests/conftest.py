"""Shared fixtures: namespaces on files and loop devices, deterministic page contents."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from radixtier.hashing import KVNamespace


def page_content(key: bytes, numel: int) -> torch.Tensor:
    """Page bytes derived from the page key, so any read can be checked without a side table."""
    raw = hashlib.shake_256(key).digest(numel * 4)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())


@pytest.fixture
def ns4() -> KVNamespace:
    return KVNamespace(model="test-model", dtype="int32", layout="flat", page_size=4)


@pytest.fixture
def ns_file(tmp_path) -> str:
    return os.path.join(str(tmp_path), "namespace.img")


@pytest.fixture
def redis_server(tmp_path):
    from redis_server import RedisServer

    srv = RedisServer(str(tmp_path / "redis"))
    yield srv
    srv.stop()
