"""Placement, backup and write-back: where new KV goes, and how copies move down the tiers.

Runs under the cache lock (serving thread, the write-back cleaner, or a completion that chains a
write after a backup); copies are started as transfers, never waited on here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from radixtier.cache.inflight import BACKING, WRITING
from radixtier.cache.state import CacheState
from radixtier.policies import WritePolicy
from radixtier.pools import PagePool
from radixtier.tiers import Tier
from radixtier.tree import Node


class Writer:
    def __init__(self, state: CacheState) -> None:
        self.s = state

    def place_new(self, node: Node, kv: torch.Tensor) -> int:
        """Cache new KV in the fastest tier with room; returns pages placed.

        A run the device has room for stays one node. A run longer than the device pool still gets
        cached: chunks that find no device slot go to host memory (and on to storage under
        write-through). A chunk that fits nowhere ends the run, and what follows it is dropped (it
        could never be a prefix hit).
        """
        s = self.s
        slots = s.evictor.alloc(Tier.DEVICE, node.num_pages)
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
        slots = s.evictor.alloc(Tier.DEVICE, node.num_pages)
        if slots is not None:
            self._on_device(node, kv, slots)
            return True
        slots = s.evictor.alloc(Tier.HOST, node.num_pages)
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

    def is_hot(self, node: Node) -> bool:
        """write_through_selective: a node hit often enough is copied down the tiers."""
        cfg = self.s.config
        return cfg.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE and node.hits >= cfg.write_through_threshold

    def backup(self, node: Node, to_storage: bool) -> None:
        """Copy a node down (device -> host, then host -> storage) in the background."""
        s = self.s
        if node.host is None:
            if node.device is None or s.inflight.get(BACKING, node) is not None:
                return
            slots = s.evictor.alloc(Tier.HOST, node.num_pages)
            if slots is None:
                chunk = s.config.promote_chunk_pages
                if node.num_pages > chunk and chunk <= s.host_pool.num_pages:
                    for part in s.tree.chunk(node, chunk):  # host room for chunks, not the node: piecewise
                        self.backup(part, to_storage)
                return
            s.completions.start_backup(node, slots, to_storage)
        elif to_storage:
            self.write_storage(node)

    def parents(self, node: Node) -> List[Optional[bytes]]:
        """Each page's parent key (the previous page of the chain), for tier 3's leaves-first order."""
        tree = self.s.tree
        above = tree.page_keys(node.parent) if node.parent is not None else []
        return [above[-1] if above else None] + list(tree.page_keys(node)[:-1])

    def write_storage(self, node: Node) -> None:
        s = self.s
        if s.store is None or node.host is None or node.in_storage or s.inflight.get(WRITING, node) is not None:
            return
        s.completions.start_write(node, self.parents(node))

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
