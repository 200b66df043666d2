"""What the cache tells tier 3 and learns from it, under the cache lock, by calls that never wait on I/O.

Owns no state. Hold hints (`hold`) tell the store which of its pages the memory tiers still hold
(its first victims); `learn_storage_evictions` applies what the store dropped on its own (for
other writers, or found corrupt) to the tree. Both are called with the cache lock held, by the
evictor and the planner (serving thread) and by the façade's apply point (transfer threads);
the store's `hold`, `take_dropped` and `exists` take only its own locks (level 2 of the lock
order in facade.py).
"""

from __future__ import annotations

from typing import Sequence

from radixtier.cache.state import CacheState


def hold(s: CacheState, keys: Sequence[bytes], held: bool) -> None:
    """Tell tier 3 that the memory tiers hold (or no longer hold) these pages, if hints are on."""
    if s.config.hold_hints and s.store is not None and keys:
        s.store.hold(keys, held)


def learn_storage_evictions(s: CacheState) -> None:
    """Apply what tier 3 dropped on its own since the last look (pages a read found corrupt) before
    planning reads from it, so a plan rarely names a page already gone. A put's evictions arrive
    with its result (outcomes.py), once."""
    if s.publisher is None:  # no store
        return
    for key in s.publisher.withdraw_dropped():  # gone from the index too: no node is sent to them again
        s.tree.storage_evicted(key)
