"""Outcomes: what a finished transfer changes in the cache, and what follow-up work it asks for.

`read(op, fut)` turns a finished transfer's future into its acknowledgement (`Ack`: the future,
per-page success, what tier 3 evicted to make room); it waits on nothing (the future is done)
and is called without the cache lock. `Outcomes.apply(op, ack)` is called with the cache lock held, only from
the façade's one apply point, on the transfer's thread. It changes the tree (slots adopted,
storage claims, locks the launcher took, prunes), returns slots that were not adopted to their
pool, clears the transfer's in-flight entries and tells the index what tier 3 now holds (the
publisher only enqueues). A failed page is never marked present.

It starts nothing and calls no other part: work that follows from an outcome (write what a
backup brought to host on down to tier 3; hold hints for pages the memory tiers now hold) is
returned as a `FollowUp` for the apply point to carry out under the same lock.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from radixtier.cache.state import CacheState
from radixtier.cache.transfers import Backup, Load, Promote, Spill, Transfer, Write, root_of
from radixtier.storage.api import PutResult
from radixtier.tiers import Tier
from radixtier.tree import Node

log = logging.getLogger("radixtier.cache")


@dataclass
class Ack:
    """A finished transfer's acknowledgement: its future (the in-flight table's entry), which of
    its pages made it, what tier 3 evicted."""

    fut: Future
    ok: List[bool]
    evicted: List[bytes]
    put: Optional[PutResult] = None  # a write's whole result (where each page went), for the index


@dataclass
class FollowUp:
    """Work an outcome asks for (one per transfer): nodes to write down to tier 3, key runs to
    hold in tier 3 (the memory tiers hold them too)."""

    write: List[Node] = field(default_factory=list)
    hold: List[List[bytes]] = field(default_factory=list)


def read(op: Transfer, fut: Future) -> Ack:
    """The acknowledgement of a finished transfer (its future is done: no waiting)."""
    n = len(op.keys)
    try:
        res = fut.result()
    except Exception as exc:
        log.warning("radixtier: transfer failed: %s", exc)
        return Ack(fut, [False] * n, [])
    if isinstance(res, PutResult):
        return Ack(fut, list(res.ok), list(res.evicted), res)
    if isinstance(res, list):
        return Ack(fut, [bool(x) for x in res], [])
    return Ack(fut, [True] * n, [])


Groups = List[Tuple[Node, int, int]]


class Outcomes:
    """Applies finished transfers to the cache (cache lock held; see module docstring)."""

    def __init__(self, state: CacheState) -> None:
        self.s = state
        self._by_type: Dict[type, Callable[..., None]] = {
            Promote: self._promoted, Load: self._loaded, Backup: self._backed_up,
            Write: self._written, Spill: self._spilled}

    def apply(self, op: Transfer, ack: Ack) -> FollowUp:
        """Apply a finished transfer's acknowledgement (cache lock held); returns the work it asks for."""
        follow = FollowUp()
        self._by_type[type(op)](op, ack, follow)
        return follow

    # ======================================================================== one per transfer type
    def _promoted(self, op: Promote, ack: Ack, follow: FollowUp) -> None:
        s = self.s
        keys, slots, source, ok = op.keys, op.slots, op.source, ack.ok
        good = next((i for i, v in enumerate(ok) if not v), len(keys))  # pages after a miss are no prefix
        # a miss on a page that meanwhile reached host another way (tier 3 may evict the pages a
        # faster tier holds first) lost nothing; nor is a miss on a page tier 3 no longer holds a
        # failed transfer: a put evicted it between the plan and the read (a plan trusts claims and
        # leading_run, and a put's victims reach the tree only when its result is applied), which
        # is an eviction, counted as one; a page freed for failing proof the store counts itself
        # (corrupt, io_errors). Only a page the store still holds and did not deliver is a failure.
        lost = 0
        if good < len(keys) and (source != Tier.STORAGE or s.store.exists([keys[good]])[0]):
            lost = sum(1 for k in keys[good:] if (hit := s.tree.node_of_key(k)) is None or hit[0].host is None)
        if lost:
            s.stats.record_failure(f"{source.label}_to_host", lost)
        used: Set[int] = set()
        for node, i, n in self._nodes_of(keys):
            s.inflight.clear(Promote.KIND, node, ack.fut)
            keep = max(0, min(n, good - i))
            if keep and keep < n:
                node = s.tree.split(node, keep)
            if keep and node.host is None:
                s.tree.set_slots(node, Tier.HOST, slots[i:i + keep])
                used.update(range(i, i + keep))
                if source == Tier.STORAGE:
                    s.tree.set_storage_pages(node, node.num_pages)
                    follow.hold.append(s.tree.page_keys(node))
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

    def _loaded(self, op: Load, ack: Ack, follow: FollowUp) -> None:
        self._adopt(op, ack.fut, Tier.DEVICE, all(ack.ok))

    def _backed_up(self, op: Backup, ack: Ack, follow: FollowUp) -> None:
        self.s.tree.unlock(op.node)
        ok = all(ack.ok)
        groups = self._adopt(op, ack.fut, Tier.HOST, ok)
        if ok and op.to_storage:
            follow.write.extend(n_ for n_, _, _ in groups)

    def _written(self, op: Write, ack: Ack, follow: FollowUp) -> None:
        s = self.s
        s.tree.unlock(op.node)
        self._stored(op.keys, ack, follow)
        for n_, _, _ in self._nodes_of(op.keys):
            s.inflight.clear(Write.KIND, n_, ack.fut)
        s.tree.prune(op.node)

    def _spilled(self, op: Spill, ack: Ack, follow: FollowUp) -> None:
        s = self.s
        groups = self._nodes_of(op.keys)
        for n_, _, _ in groups:
            s.inflight.clear(Spill.KIND, n_, ack.fut)
            s.inflight.end_spill(n_.id)
        s.inflight.end_spill(op.node.id)
        self._stored(op.keys, ack, follow, op.root)
        for n_, _, _ in groups:
            s.tree.prune(n_)

    # ======================================================================== shared
    def _stored(self, keys: List[bytes], ack: Ack, follow: FollowUp, root: Optional[bytes] = None) -> None:
        """Record pages the store now holds; drop claims for pages it evicted; tell the index."""
        s = self.s
        ok, evicted = ack.ok, ack.evicted
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
                follow.hold.append(s.tree.page_keys(n_)[:run])
        if s.publisher is not None and ack.put is not None:
            if root is None:
                root = root_of(s.tree, groups[0][0]) if groups else keys[0]
            s.publisher.stored(root, keys, ack.put)

    def _adopt(self, op: Load | Backup, fut: Future, tier: Tier, ok: bool) -> Groups:
        """A copy into `tier` finished: give each node its slots, free the rest, clear the in-flight mark."""
        s = self.s
        slots = op.slots
        groups = self._nodes_of(op.keys)
        used: Set[int] = set()
        for node, i, n in groups:
            s.inflight.clear(op.KIND, node, fut)
            if ok and node.slots(tier) is None and n == node.num_pages:
                s.tree.set_slots(node, tier, slots[i:i + n])
                used.update(range(i, i + n))
        s.pools[tier].free([sl for j, sl in enumerate(slots) if j not in used])
        return groups

    def _nodes_of(self, keys: Sequence[bytes]) -> Groups:
        """(node, first index into keys, count) groups: a transfer's pages may span nodes split meanwhile."""
        groups: Groups = []
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
