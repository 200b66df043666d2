"""The tiers a KV page can live in, fastest first."""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    DEVICE = 0  # GPU HBM page pool (cpu tensors when no CUDA)
    HOST = 1  # host DRAM page pool (pinned when CUDA is present)
    STORAGE = 2  # this node's tier-3 page store (NVMe-oF namespace or file)
    REMOTE = 3  # a page another node published to the prefix index

    @property
    def label(self) -> str:
        return _LABELS[self]  # a dict read: enum's own `name` is two descriptor calls, on every lookup


_LABELS = {t: t.name.lower() for t in Tier}
