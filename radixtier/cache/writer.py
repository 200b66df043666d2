"""Placement, backup and write-back: where new KV goes, and how copies move down the tiers.

Owns no state of its own. Writes new KV into pool slots and gives them to tree nodes, under the
cache lock: on the serving thread (the façade's insert, the planner's hot backups), the
write-back cleaner, or the façade's apply point (a backup whose outcome asks for the write to
tier 3 that follows it). Uses the evictor (room) and the launcher (copies down the tiers, started
as transfers, never waited on here); nothing calls back into it from below.
"""

from __future__ import annotations

from typing import Sequence

import torch

from radixtier.cache.evictor import Evictor
from radixtier.cache.inflight import BACKING, WRITING
from radixtier.cache.state import CacheState
from radixtier.cache.transfers import Launcher
from radixtier.policies import WritePolicy
from radixtier.pools import PagePool
from radixtier.tiers import Tier
from radixtier.tree import Node


class Writer:
    """Placement and copies down the tiers (cache lock held; see module docstring)."""

    def __init__(self, state: CacheState, evictor: Evictor, launcher: Launcher) -> None:
        self.s = state
        self._evictor = evictor
        self._launcher = launcher

    def place_new(self, node: Node, kv: torch.Tensor) -> int:
        """Cache new KV in the fastest tier with room; returns pages placed.

        A run the device has room for stays one node. A run longer than the device pool still gets
        cached: chunks that find no device slot go to host memory (and on to storage under
        write-through). A chunk that fits nowhere ends the run, and what follows it is dropped (it
        could never be a prefix hit).
        """
        s = self.s
        slots = self._evictor.alloc(Tier.DEVICE, node.num_pages)
        if slots is not None:  # the common case: one node, one allocation (the tree stays compact)
            placed = node.num_pages  # counted first: a piecewise backup may split the node
            self._on_device(node, kv, slots)
            return placed
        placed = 0
        chunks = s.tree.chunk(node, s.config.promote_chunk_pages)
        for i, chunk in enumerate(chunks):
            part = kv[placed:placed + chunk.num_pages]
            if not self._place_chunk(chunk, part):
                for rest in reversed(chunks[i:]):
                    s.tree.prune(rest)
                break
            placed += chunk.num_pages
        return placed

    def _place_chunk(self, node: Node, kv: torch.Tensor) -> bool:
        s = self.s
        slots = self._evictor.alloc(Tier.DEVICE, node.num_pages)
        if slots is not None:
            self._on_device(node, kv, slots)
            return True
        slots = self._evictor.alloc(Tier.HOST, node.num_pages)
        if slots is None:
            return False
        s.host_pool.write(slots, kv)
        s.tree.set_slots(node, Tier.HOST, slots)
        if s.config.write_policy == WritePolicy.WRITE_THROUGH:
            self.write_storage(node)
        return True

    def _on_device(self, node: Node, kv: torch.Tensor, slots: Sequence[int]) -> None:
        s = self.s
        s.device_pool.write(slots, kv)
        s.tree.set_slots(node, Tier.DEVICE, slots)
        if s.config.write_policy == WritePolicy.WRITE_THROUGH:
            self.backup(node, to_storage=True)

    def backup(self, node: Node, to_storage: bool) -> None:
        """Copy a node down (device -> host, then host -> storage) in the background."""
        s = self.s
        if node.host is None:
            if node.device is None or s.inflight.get(BACKING, node) is not None:
                return
            slots = self._evictor.alloc(Tier.HOST, node.num_pages)
            if slots is None:
                chunk = s.config.promote_chunk_pages
                if node.num_pages > chunk and chunk <= s.host_pool.num_pages:
                    for part in s.tree.chunk(node, chunk):  # host room for chunks, not the node: piecewise
                        self.backup(part, to_storage)
                return
            self._launcher.start_backup(node, slots, to_storage)
        elif to_storage:
            self.write_storage(node)

    def write_storage(self, node: Node) -> None:
        """Copy a node's host pages down to tier 3 in the background (if it needs it and can)."""
        s = self.s
        if s.store is None or node.host is None or node.in_storage or s.inflight.get(WRITING, node) is not None:
            return
        self._launcher.start_write(node)

    def needs_cleaning(self) -> bool:
        """write_back: a memory tier is past its spill watermark (cache lock held)."""
        return any(self._past_watermark(pool) for pool in (self.s.device_pool, self.s.host_pool))

    def _past_watermark(self, pool: PagePool) -> bool:
        return pool.num_used > self.s.config.spill_watermark * pool.num_pages

    def clean_once(self) -> None:
        """write_back: keep the LRU end of each tier clean, so evictions rarely wait on a copy."""
        s = self.s
        cfg = s.config
        with s.lock:
            for tier in (Tier.DEVICE, Tier.HOST):
                pool = s.pools[tier]
                if not self._past_watermark(pool):
                    continue
                budget = pool.num_used - (cfg.spill_watermark - 0.1) * pool.num_pages
                for node in s.tree.victims(tier, 64):
                    if budget <= 0:
                        break
                    if tier == Tier.DEVICE and node.host is None and s.inflight.get(BACKING, node) is None:
                        self.backup(node, to_storage=False)
                    elif tier == Tier.HOST and not node.in_storage:
                        self.write_storage(node)
                    budget -= node.num_pages
