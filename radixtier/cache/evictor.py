"""Eviction: making room in a memory tier, and what a victim's pages need before they go.

Owns no state of its own. Changes the tree and the pools (victims' slots, splits, prunes) under
the cache lock, on whichever thread asks for room: the planner, the writer and the façade
(serving thread) or the write-back cleaner. Uses the launcher to start a spill and nothing
above it: a spill's outcome is applied by the façade's apply point, never called back into here.

Never waits on tier-3 I/O: a host victim that must be written down first (write_back, hot, or
tier 3 let go of it) is copied into a staging buffer (a memory copy) and written by a transfer,
so the serving thread never waits on an fdatasync while it holds the lock. That inline spill is
counted (`inline_spill_pages`): write_back's cleaner exists to keep it rare. A device victim
with no host copy is copied device -> host synchronously (no disk).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import numpy as np

from radixtier.cache import tier3
from radixtier.cache.inflight import WRITING
from radixtier.cache.copy_rules import must_keep_copy
from radixtier.cache.state import CacheState
from radixtier.cache.transfers import Launcher
from radixtier.tiers import Tier
from radixtier.tree import Node

log = logging.getLogger("radixtier.cache")


class Evictor:
    """Makes room in a memory tier (cache lock held; see module docstring)."""

    def __init__(self, state: CacheState, launcher: Launcher) -> None:
        self.s = state
        self._launcher = launcher

    def alloc(self, tier: Tier, n: int) -> Optional[List[int]]:
        """n free slots in a memory tier, evicting unlocked pages if needed; None if it cannot."""
        pool = self.s.pools[tier]
        if n > pool.num_pages:  # no eviction can make that room
            return None
        slots = pool.try_alloc(n)
        if slots is None and self.reclaim(tier, n):
            slots = pool.try_alloc(n)
        return slots

    def reclaim(self, tier: Tier, need_free: int) -> bool:
        """Evict unlocked pages until `tier` has need_free free slots; False if it ran out of victims."""
        s = self.s
        pool = s.pools[tier]
        tier3.learn_storage_evictions(s)  # what leaves a tier must know whether tier 3 still has it
        freed: List[np.ndarray] = []  # returned to the pool in one call when the loop ends
        pending = 0
        # the pool's count stays put in the loop: its frees wait for the end, and the loop allocates
        # only from the other tier (a device victim's host copy)
        short = need_free - pool.num_free
        try:
            while pending < short:
                victim = s.tree.peek_victim(tier)
                if victim is None:
                    return False
                tail = self._tail_pages(victim, short - pending)
                if tail < victim.num_pages:
                    if self._goes_outright(victim, tier):  # nothing else holds it: drop the tail in place
                        freed.append(s.tree.drop_tail(victim, tier, tail))
                        pending += tail
                        continue
                    s.tree.split(victim, victim.num_pages - tail)  # the victim keeps its last `tail` pages
                pending += self._evict_node(victim, tier, freed)
            return True
        finally:
            if freed:
                pool.free_runs(freed)
                s.stats.record_eviction(tier, pending)

    def _tail_pages(self, victim: Node, short: int) -> int:
        """How much of a victim goes: a victim far larger than what is still needed gives up only
        its tail, the whole chunks (promote_chunk_pages) that cover the shortfall. The rest stays
        cached, as it did when new KV was placed chunk by chunk (an insert now stays one node)."""
        chunk = self.s.config.promote_chunk_pages
        return min(victim.num_pages, -(-short // chunk) * chunk)

    def _goes_outright(self, node: Node, tier: Tier) -> bool:
        """Its pages leave the cache with no copy made and no trace elsewhere: a leaf never hashed
        (so never in tier 3 or the index), in no other memory tier, with nothing in flight, and
        no copy wanted (or no room that could ever take one). Such a tail is dropped in place."""
        s = self.s
        if node.children or node.keys is not None or node.storage_pages or s.inflight.busy(node):
            return False
        if tier == Tier.DEVICE:
            return node.host is None and not (must_keep_copy(s, node) and self._host_could_copy())
        return node.device is None and not (s.store is not None and must_keep_copy(s, node))

    def _host_could_copy(self) -> bool:
        """Whether a device victim's host copy is ever attempted (see _copy_to_host)."""
        return self.s.config.promote_chunk_pages <= self.s.host_pool.num_pages

    def _evict_node(self, node: Node, tier: Tier, freed: List[np.ndarray]) -> int:
        """Take a victim out of `tier`; its slots go on `freed` (for the caller to return) as soon as
        they leave the node, so nothing after that can lose them. Returns how many."""
        s = self.s
        if tier == Tier.DEVICE:
            if node.host is None and must_keep_copy(s, node):
                self._copy_to_host(node)
        elif tier == Tier.HOST:
            if (s.store is not None and not node.in_storage and s.inflight.get(WRITING, node) is None
                    and must_keep_copy(s, node)):
                self._spill_inline(node)
        slots = s.tree.clear_slots(node, tier)
        freed.append(slots)
        if node.device is None and node.host is None and node.keys is not None:
            tier3.hold(s, node.keys, False)  # tier 3 has the only copy now (if it has one; never, if never hashed)
        s.tree.prune(node)
        return len(slots)

    def _copy_to_host(self, node: Node) -> None:
        """A device victim's inline device -> host copy (no clean victim was left): the node, or
        its last chunk where the host has room for a chunk only. A host pool too small for
        either (nothing to evict there could help) costs no allocation attempt."""
        s = self.s
        chunk = s.config.promote_chunk_pages
        if node.num_pages > s.host_pool.num_pages and not self._host_could_copy():
            return
        slots = self.alloc(Tier.HOST, node.num_pages)
        if slots is None and node.num_pages > chunk:  # host room for a chunk, not the node?
            slots = self.alloc(Tier.HOST, chunk)
            if slots is not None:
                s.tree.split(node, node.num_pages - chunk)  # the victim keeps its last chunk
        if slots is None:
            return
        try:
            s.mover.copy_now(s.device_pool, node.device, s.host_pool, slots)
        except Exception as exc:  # the page is dropped (a later miss), never half-copied
            log.warning("radixtier: inline device->host spill failed: %s", exc)
            s.stats.record_failure("device_to_host", node.num_pages)
            s.host_pool.free(slots)
        else:
            s.tree.set_slots(node, Tier.HOST, slots)

    def _spill_inline(self, node: Node) -> None:
        """A host victim that must reach tier 3 first: stage its pages (a memory copy, under the
        lock) and write them by a transfer (not under the lock). Until that write is applied the
        pages are in no tier: a request in that window recomputes them."""
        s = self.s
        try:
            staged = s.host_pool.read(node.host)
        except Exception as exc:  # the page leaves the cache (a later miss); serving goes on
            log.warning("radixtier: inline host->storage spill failed: %s", exc)
            s.stats.record_failure("host_to_storage", node.num_pages)
            return
        s.stats.record_inline_spill(node.num_pages)
        self._launcher.start_spill(node, staged)
