"""What the cache's parts share, and who owns each field.

Everything here is created once by the façade (`TieredKVCache`) and never replaced. Fields that
change at run time, and who may change them:
- `tree`, `device_pool`, `host_pool`, `inflight`'s node table: only under `lock`, by the
  planner (serving thread), the writer, the evictor and the completions (transfer threads);
- `stats`: thread-safe counters, anyone;
- `store`, `publisher`, `mover`: thread-safe objects with their own locks (leaves of the lock
  order); calls that can wait on I/O (store.put/get, index lookups) are never made under `lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

from radixtier.cache.config import CacheConfig
from radixtier.cache.inflight import InFlight
from radixtier.hashing import KVNamespace, PageHasher
from radixtier.metrics import CacheStats
from radixtier.pools import PagePool
from radixtier.storage.api import PageStore
from radixtier.storage.publisher import Publisher
from radixtier.tiers import Tier
from radixtier.transfer import TransferEngine
from radixtier.tree import RadixTree

if TYPE_CHECKING:  # pragma: no cover
    from radixtier.cache.completions import Completions
    from radixtier.cache.evictor import Evictor
    from radixtier.cache.writer import Writer


@dataclass
class CacheState:
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
    mover: TransferEngine
    inflight: InFlight
    lock: threading.RLock
    # the parts, for calls across them (set once by the façade)
    writer: "Writer" = None  # type: ignore[assignment]
    evictor: "Evictor" = None  # type: ignore[assignment]
    completions: "Completions" = None  # type: ignore[assignment]
