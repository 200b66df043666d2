"""SGLang's host pools as the backend sees them: each pool's page format, its slot count (the bound
host_indices are checked against) and the host memory io_uring may register.

These read attributes of SGLang's HostKVCache classes (`page_size`, `size`, `kv_buffer`, ...),
not of radixtier's own objects: which attributes a pool has depends on SGLang's pool type.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from radixtier.integrations.sglang.backend.keys import PoolFormat

log = logging.getLogger("radixtier.sglang")


def pool_format(name: str, pool) -> PoolFormat:
    """Page size in bytes as the zero-copy walk sees it (the flat page holds the same bytes), and
    whether the walk works at all: mamba/DSA pools raise outside page_first layouts, so probe once."""
    page_size = int(getattr(pool, "page_size", 1) or 1)
    nbytes = 0
    if hasattr(pool, "get_page_buffer_meta"):
        try:
            _ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size))
            nbytes = int(sum(sizes))
        except Exception as exc:  # some pools support the walk in some layouts only
            log.info("radixtier: pool %s: no zero-copy page walk in this layout (%s); using flat pages", name, exc)
            nbytes = 0
    zero_copy = nbytes > 0
    if not nbytes:
        page = pool.get_dummy_flat_data_page()
        nbytes = page.numel() * page.element_size()
    return PoolFormat(name, str(getattr(pool, "layout", "unknown")), str(getattr(pool, "dtype", "unknown")), nbytes,
                      zero_copy)


def host_regions(pools) -> List[Tuple[int, int]]:
    """(address, nbytes) of each host pool's KV memory (SGLang's `kv_buffer`: one tensor, or one
    per layer), distinct and on the CPU only."""
    seen: Dict[int, int] = {}
    for pool in pools:
        buf = getattr(pool, "kv_buffer", None)  # SGLang's HostKVCache attribute, not ours
        for t in buf if isinstance(buf, (list, tuple)) else [buf]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sorted(seen.items())


def pool_slots(name: str, pool) -> int:
    """Slots in a host pool (SGLang's HostKVCache.size): the bound every host index is checked against."""
    size = getattr(pool, "size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise RuntimeError(f"host pool {name!r}: expected a slot count (size) to check host_indices against, "
                           f"got {size!r}")
    return size
