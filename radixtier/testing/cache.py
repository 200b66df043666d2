"""Helpers for tests of the embedded TieredKVCache: a small CPU cache over 4 KiB int32 pages, the
KV a prompt's pages should hold (derived from their keys), and a check that a match returned it."""

from __future__ import annotations

import torch

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import PageHasher
from radixtier.testing.pages import page_content

NUMEL = 1024  # int32 elements per page: 4 KiB pages


def make_cache(ns, store=None, index=None, **kw) -> TieredKVCache:
    """16 device and 32 host pages on the CPU; `kw` overrides any CacheConfig field."""
    cfg = dict(page_size=ns.page_size, page_shape=(NUMEL,), dtype=torch.int32, device_pages=16,
               host_pages=32, device="cpu")
    cfg.update(kw)
    return TieredKVCache(CacheConfig(**cfg), ns, store=store, index=index)


def kv_for(ns, tokens, first_page=0) -> torch.Tensor:
    """The KV of `tokens`' pages from `first_page` on, one row per page."""
    keys = PageHasher(ns).chain(tokens)
    return torch.stack([page_content(k, NUMEL) for k in keys[first_page:]])


def check_prefix(cache, ns, tokens, result) -> None:
    """Assert that the device pages of a match hold exactly the KV of `tokens`' matched pages."""
    keys = PageHasher(ns).chain(tokens)[:result.num_pages]
    got = cache.gather(result.device_slots)
    for i, k in enumerate(keys):
        assert torch.equal(got[i], page_content(k, NUMEL)), f"page {i} bytes differ"
