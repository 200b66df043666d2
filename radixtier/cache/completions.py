"""Transfers: started on the serving thread, finished on the transfer engine's threads.

`start_*` submit a copy to the transfer engine, record it in the in-flight table and register
its completion (called with the cache lock held, from the planner, the writer or the evictor).
`_on_*` are the only code that runs on transfer threads: each takes the cache lock once, applies
the outcome (a failed page is never marked present; slots that were not adopted go back to
their pool), clears the in-flight entry, and publishes what tier 3 now holds.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import List, Optional, Sequence, Set, Tuple

import torch

from radixtier.cache.inflight import BACKING, LOADING, PROMOTING, WRITING
from radixtier.cache.state import CacheState
from radixtier.storage.api import PageRecord, PutResult
from radixtier.tiers import Tier
from radixtier.tree import Node

log = logging.getLogger("radixtier.cache")


class Completions:
    def __init__(self, state: CacheState) -> None:
        self.s = state

    # ======================================================================== starting (cache lock held)
    def start_promotion(self, node: Node, slots: List[int], source: Tier,
                        records: Optional[List[PageRecord]] = None) -> Future:
        s = self.s
        keys = list(s.tree.page_keys(node))
        if source == Tier.STORAGE:
            fut = s.mover.storage_to_host(keys, slots)
        else:
            fut = s.mover.remote_to_host([r.location for r in records or []], keys, slots)
        s.inflight.put(PROMOTING, node, fut)
        s.inflight.track(fut, lambda f: self._on_promoted(f, keys, slots, source))
        return fut

    def start_load(self, node: Node, slots: List[int]) -> Future:
        s = self.s
        keys = list(s.tree.page_keys(node))
        fut = s.mover.host_to_device(list(node.host), slots)
        s.inflight.put(LOADING, node, fut)
        s.inflight.track(fut, lambda f: self._on_loaded(f, keys, slots))
        return fut

    def start_backup(self, node: Node, slots: List[int], to_storage: bool) -> Future:
        s = self.s
        s.tree.lock(node)  # the source pages must not move while they are read
        keys = list(s.tree.page_keys(node))
        fut = s.mover.device_to_host(list(node.device), slots)
        s.inflight.put(BACKING, node, fut)
        s.inflight.track(fut, lambda f: self._on_backed_up(f, node, keys, slots, to_storage))
        return fut

    def start_write(self, node: Node, parents: List[Optional[bytes]]) -> Future:
        s = self.s
        s.tree.lock(node)
        keys = list(s.tree.page_keys(node))
        fut = s.mover.host_to_storage(list(node.host), keys, parents)
        s.inflight.put(WRITING, node, fut)
        s.inflight.track(fut, lambda f: self._on_written(f, node, keys))
        return fut

    def start_spill(self, node: Node, staged: torch.Tensor, parents: List[Optional[bytes]]) -> Future:
        """Write a staged copy of an evicted node's pages down; the node stays in the tree (busy)
        until the write is applied, so tier 3's copy is found again."""
        s = self.s
        keys = list(s.tree.page_keys(node))
        root = self.root_of(node)
        s.inflight.begin_spill(node)
        fut = s.mover.pages_to_storage(staged, keys, parents)
        s.inflight.put(WRITING, node, fut)
        s.inflight.track(fut, lambda f: self._on_spilled(f, node, keys, root))
        return fut

    def root_of(self, node: Node) -> bytes:
        """The chain's page 0, under which the index groups a chain's records."""
        tree = self.s.tree
        return tree.page_keys(tree.path_to_root(node)[0])[0]

    # ======================================================================== finishing (transfer threads)
    def _on_promoted(self, fut: Future, keys: List[bytes], slots: List[int], source: Tier) -> None:
        s = self.s
        ok = _outcome(fut, len(keys))
        good = next((i for i, v in enumerate(ok) if not v), len(keys))  # pages after a miss are no prefix
        with s.lock:
            # a miss on a page that meanwhile reached host another way (tier 3 may evict the pages a
            # faster tier holds first) lost nothing; only the others are failed transfers
            lost = sum(1 for k in keys[good:] if (hit := s.tree.node_of_key(k)) is None or hit[0].host is None)
            if lost:
                s.stats.record_failure(f"{source.label}_to_host", lost)
            used: Set[int] = set()
            for node, i, n in self._nodes_of(keys):
                s.inflight.clear(PROMOTING, node, fut)
                keep = max(0, min(n, good - i))
                if keep and keep < n:
                    node = s.tree.split(node, keep)
                if keep and node.host is None:
                    s.tree.set_slots(node, Tier.HOST, slots[i:i + keep])
                    used.update(range(i, i + keep))
                    if source == Tier.STORAGE:
                        s.tree.set_storage_pages(node, node.num_pages)
                        s.evictor.hold(s.tree.page_keys(node), True)
                if keep < n and source == Tier.STORAGE:
                    # the store proved these pages absent or corrupt (it freed them): drop the claim
                    hit = s.tree.node_of_key(keys[i + keep])
                    if hit is not None:
                        s.tree.set_storage_pages(hit[0], min(hit[0].storage_pages, hit[1]))
            s.host_pool.free([sl for j, sl in enumerate(slots) if j not in used])
            for key in keys:
                hit = s.tree.node_of_key(key)
                if hit is not None:
                    s.tree.prune(hit[0])

    def _on_loaded(self, fut: Future, keys: List[bytes], slots: List[int]) -> None:
        ok = all(_outcome(fut, len(slots)))
        with self.s.lock:
            self._adopt(fut, keys, slots, Tier.DEVICE, LOADING, ok)

    def _on_backed_up(self, fut: Future, node: Node, keys: List[bytes], slots: List[int], to_storage: bool) -> None:
        s = self.s
        ok = all(_outcome(fut, len(slots)))
        with s.lock:
            s.tree.unlock(node)
            groups = self._adopt(fut, keys, slots, Tier.HOST, BACKING, ok)
            if ok and to_storage:
                for n_, _, _ in groups:
                    s.writer.write_storage(n_)

    def _on_written(self, fut: Future, node: Node, keys: List[bytes]) -> None:
        s = self.s
        ok = _outcome(fut, len(keys))
        evicted = _evicted(fut)
        with s.lock:
            s.tree.unlock(node)
            self.apply_storage(keys, ok, evicted)
            for n_, _, _ in self._nodes_of(keys):
                s.inflight.clear(WRITING, n_, fut)
            s.tree.prune(node)

    def _on_spilled(self, fut: Future, node: Node, keys: List[bytes], root: bytes) -> None:
        s = self.s
        ok = _outcome(fut, len(keys))
        evicted = _evicted(fut)
        with s.lock:
            groups = self._nodes_of(keys)
            for n_, _, _ in groups:
                s.inflight.clear(WRITING, n_, fut)
                s.inflight.end_spill(n_.id)
            s.inflight.end_spill(node.id)
            self.apply_storage(keys, ok, evicted, root)
            for n_, _, _ in groups:
                s.tree.prune(n_)

    # ======================================================================== shared (cache lock held)
    def apply_storage(self, keys: List[bytes], ok: List[bool], evicted: List[bytes],
                      root: Optional[bytes] = None) -> None:
        """Record pages the store now holds; drop claims for pages it evicted; tell the index."""
        s = self.s
        for key in evicted:
            s.tree.storage_evicted(key)
        if evicted:
            s.stats.record_eviction(Tier.STORAGE, len(evicted))
        groups = self._nodes_of(keys)
        for n_, i, n in groups:
            run = 0
            while run < n and ok[i + run]:
                run += 1
            s.tree.set_storage_pages(n_, max(n_.storage_pages, run))
            if run and (n_.device is not None or n_.host is not None):
                s.evictor.hold(s.tree.page_keys(n_)[:run], True)
        if s.publisher is not None:
            if root is None:
                root = self.root_of(groups[0][0]) if groups else keys[0]
            s.publisher.stored(root, keys, ok, evicted)

    def _adopt(self, fut: Future, keys: List[bytes], slots: List[int], tier: Tier, kind: str,
               ok: bool) -> List[Tuple[Node, int, int]]:
        """A copy into `tier` finished: give each node its slots, free the rest, clear the in-flight mark."""
        s = self.s
        groups = self._nodes_of(keys)
        used: Set[int] = set()
        for node, i, n in groups:
            s.inflight.clear(kind, node, fut)
            if ok and node.slots(tier) is None and n == node.num_pages:
                s.tree.set_slots(node, tier, slots[i:i + n])
                used.update(range(i, i + n))
        s.pools[tier].free([sl for j, sl in enumerate(slots) if j not in used])
        return groups

    def _nodes_of(self, keys: Sequence[bytes]) -> List[Tuple[Node, int, int]]:
        """(node, first index into keys, count) groups: a transfer's pages may span nodes split meanwhile."""
        groups: List[Tuple[Node, int, int]] = []
        for i, key in enumerate(keys):
            hit = self.s.tree.node_of_key(key)
            if hit is None:
                continue
            node = hit[0]
            if groups and groups[-1][0] is node:
                groups[-1] = (node, groups[-1][1], groups[-1][2] + 1)
            else:
                groups.append((node, i, 1))
        return groups


def _outcome(fut: Future, n: int) -> List[bool]:
    try:
        res = fut.result()
    except Exception as exc:
        log.warning("radixtier: transfer failed: %s", exc)
        return [False] * n
    if isinstance(res, PutResult):
        return list(res.ok)
    if isinstance(res, list):
        return [bool(x) for x in res]
    return [True] * n


def _evicted(fut: Future) -> List[bytes]:
    if fut.exception() is None and isinstance(fut.result(), PutResult):
        return list(fut.result().evicted)
    return []
