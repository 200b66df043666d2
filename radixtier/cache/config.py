"""CacheConfig: sizes and policies of one node's embedded tiered cache, validated in one place
(with the same shared checks, radixtier/validate.py, as the store's and SGLang's settings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Tuple, Union

import torch

from radixtier.policies import PrefetchPolicy, WritePolicy, parse_enum
from radixtier.pools import resolve_device
from radixtier.eviction import EVICTION_MODES, LEAVES_FIRST
from radixtier.validate import one_of, positive_int


@dataclass
class CacheConfig:
    """Sizes and policies of one node's tiered cache. `validated()` names any bad field."""

    page_size: int = 16
    page_shape: Tuple[int, ...] = (16,)  # elements of one KV page, e.g. (layers, 2, kv_heads, page_size, head_dim)
    dtype: torch.dtype = torch.float16
    device_pages: int = 256
    host_pages: int = 1024
    device: str = "auto"
    write_policy: Union[str, WritePolicy] = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch_policy: Union[str, PrefetchPolicy] = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 1.0
    promote_chunk_pages: int = 64
    spill_watermark: float = 0.85
    io_workers: int = 4
    eviction: str = LEAVES_FIRST
    # Tell tier 3 which of its pages device/host still hold: those are its first victims, and
    # write_through writes a page back down when the upper tiers let go of it without a copy.
    hold_hints: bool = True

    def validated(self) -> "CacheConfig":
        for name in ("page_size", "device_pages", "host_pages", "write_through_threshold",
                     "promote_chunk_pages", "io_workers"):
            positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        try:
            shape = tuple(int(d) for d in self.page_shape)
        except (TypeError, ValueError):
            raise ValueError(f"page_shape: expected a tuple of positive integers, got {self.page_shape!r}") from None
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"page_shape: expected a tuple of positive integers, got {self.page_shape!r}")
        t = self.prefetch_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < math.inf:
            raise ValueError(f"prefetch_timeout_s: expected a non-negative, finite number of seconds, got {t!r}")
        w = self.spill_watermark
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.1 <= w <= 1.0:
            raise ValueError(f"spill_watermark: expected a fraction in [0.1, 1.0], got {w!r}")
        one_of("eviction", self.eviction, EVICTION_MODES)
        resolve_device(self.device)
        return replace(self, page_shape=shape,
                       write_policy=parse_enum(WritePolicy, "write_policy", self.write_policy),
                       prefetch_policy=parse_enum(PrefetchPolicy, "prefetch_policy", self.prefetch_policy))

    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()
