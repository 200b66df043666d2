"""An SGLang HiCache backend that moves no bytes: the floor of SGLang's own L3 path.

sglang_path.py times backup and prefetch end to end through SGLang's controller: hashing,
queues, thread hand-offs, the scheduler's steps, host allocation. This backend remembers which
keys were "stored" and answers every call at once, so a run with it measures that machinery
alone; a real backend's time above it is what its I/O costs. Bench only: it never holds data.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo


class NullStorage(HiCacheStorage):
    """Keys only; reads report success without touching host memory (see module docstring)."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None) -> None:
        self._keys: set = set()
        self._lock = threading.Lock()

    def _have(self, keys: List[str]) -> List[bool]:
        with self._lock:
            return [k in self._keys for k in keys]

    def _add(self, keys: List[str]) -> List[bool]:
        with self._lock:
            self._keys.update(keys)
        return [True] * len(keys)

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        n = 0
        for have in self._have(keys):
            if not have:
                break
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self._have([key])[0]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._have(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        return self._add(keys)

    def get(self, key, target_location=None, target_sizes=None):
        return target_location if self.exists(key) else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [t if h else None for t, h in zip(target_locations or [None] * len(keys), self._have(keys))]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self._add([key])[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self._add(keys))

    def clear(self) -> bool:
        with self._lock:
            self._keys.clear()
        return True
