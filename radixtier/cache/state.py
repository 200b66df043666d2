"""What the cache's parts share, and who owns each field. Data only: no part is reachable from here.

Everything here is created once by the façade (`TieredKVCache`) and never replaced. The parts
(planner, writer, evictor, launcher, outcomes) each get this state and, at construction, the
parts below them (see facade.py for the map); none of them is a field here, so a part can
reach another only through what the façade handed it. Fields that change at run time, and who
may change them:
- `tree`, `device_pool`, `host_pool`, `inflight`'s node table: only under `lock`, by the
  planner, the writer and the evictor (serving thread, write-back cleaner), the launcher (the
  locks on a transfer's source and its in-flight entry) and the outcomes (transfer threads,
  through the façade's one apply point);
- `stats`: thread-safe counters, anyone;
- `store`, `publisher`, `mover`: thread-safe objects with their own locks (leaves of the lock
  order); calls that can wait on I/O (store.put/get, index lookups) are never made under `lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional

from radixtier.cache.config import CacheConfig
from radixtier.cache.inflight import InFlight
from radixtier.hashing import KVNamespace, PageHasher
from radixtier.metrics import CacheStats
from radixtier.pools import PagePool
from radixtier.storage.api import PageStore
from radixtier.storage.publisher import Publisher
from radixtier.tiers import Tier
from radixtier.mover import PageMover
from radixtier.tree import RadixTree


@dataclass
class CacheState:
    """The shared data of one cache (see module docstring for who may change which field)."""

    config: CacheConfig
    namespace: KVNamespace
    hasher: PageHasher
    tree: RadixTree
    device_pool: PagePool
    host_pool: PagePool
    pools: Dict[Tier, PagePool]
    store: Optional[PageStore]
    publisher: Optional[Publisher]  # None without a store (nothing to publish or read remotely)
    stats: CacheStats
    mover: PageMover
    inflight: InFlight
    lock: threading.RLock
