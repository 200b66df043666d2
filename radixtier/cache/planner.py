"""Planning a request's prefix: what is cached where, what to promote, what to load (no waiting on I/O).

Owns no state of its own; the fields of a `PrefixHandle` it made are written only here. Runs on
the serving thread. Everything that reads or changes the tree runs under the cache lock; the
only calls made outside it are the prefix index's lookups (network) and waits on transfers.
Uses the writer (hot backups), the evictor (room) and the launcher (promotions and loads, as
transfers); their outcomes are applied by the façade's apply point, on the transfer's thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Dict, List, Optional, Union

import numpy as np

from radixtier.cache import tier3
from radixtier.cache.evictor import Evictor
from radixtier.cache.handle import LoadResult, MatchResult, PrefixHandle
from radixtier.cache.inflight import LOADING, PROMOTING
from radixtier.cache.copy_rules import is_hot
from radixtier.cache.state import CacheState
from radixtier.cache.transfers import Launcher
from radixtier.cache.writer import Writer
from radixtier.hashing import as_token_array
from radixtier.policies import PrefetchPolicy, parse_enum
from radixtier.storage.api import PageRecord
from radixtier.tiers import Tier
from radixtier.tree import Node, TreeMatch


class Planner:
    """match / prefetch / load / release (see module docstring)."""

    def __init__(self, state: CacheState, writer: Writer, evictor: Evictor, launcher: Launcher) -> None:
        self.s = state
        self._writer = writer
        self._evictor = evictor
        self._launcher = launcher

    # ======================================================================== public
    def match(self, tokens, beyond_memory: bool = True) -> MatchResult:
        """Longest cached prefix with its per-tier split; starts no transfer and takes no lock on pages.
        beyond_memory=False stops at what the tree knows (no tier-3 or index lookup): cheap enough
        for the serving path."""
        s = self.s
        arr = as_token_array(tokens, check_values=False)  # read-only: a bad id just matches nothing
        ps = s.config.page_size
        with s.lock:
            m = s.tree.match(arr)
            if not m.nodes and (not beyond_memory or s.store is None):
                return MatchResult(0)  # a miss at the root, with nothing beyond memory to ask
            pages = s.tree.usable_prefix(m).pages_by_tier()
            res = MatchResult(0)
            res.device_tokens = pages[Tier.DEVICE] * ps
            res.host_tokens = pages[Tier.HOST] * ps
            res.storage_tokens = pages[Tier.STORAGE] * ps
            if not beyond_memory:
                res.prefix_tokens = res.device_tokens + res.host_tokens + res.storage_tokens
                return res
            done = pages[Tier.DEVICE] + pages[Tier.HOST] + pages[Tier.STORAGE]
            tail = self._tail_keys(m, arr, done)
            n = s.store.leading_run(tail) if (s.store is not None and tail) else 0
            res.storage_tokens += n * ps
        rest = tail[n:]
        if rest:
            res.remote_tokens = len(self._remote_run(self._root_key(arr), rest)) * ps
        res.prefix_tokens = res.device_tokens + res.host_tokens + res.storage_tokens + res.remote_tokens
        return res

    def prefetch(self, tokens) -> PrefixHandle:
        """Lock the cached prefix and start storage/remote -> host promotion in the background."""
        s = self.s
        arr = as_token_array(tokens)
        h = PrefixHandle(self, arr.size)
        with s.lock:
            tier3.learn_storage_evictions(s)
            m = s.tree.match(arr)
            up = s.tree.usable_prefix(m)
            s.tree.touch(up.nodes)
            for node, tier in zip(up.nodes, up.tiers):
                running = s.inflight.get(PROMOTING, node)
                if tier == Tier.STORAGE and running is not None:
                    # another request is promoting it: wait on that transfer, never read it twice
                    s.tree.lock(node)
                    h.locked.append(node)
                    h.stages.append(running)
                    self._plan(h, node, Tier.STORAGE)
                elif tier == Tier.STORAGE:
                    for chunk in s.tree.chunk(node, s.config.promote_chunk_pages):
                        if not self._start_promotion(h, [chunk], Tier.STORAGE):
                            return self._finish_plan(h)
                else:
                    self._plan(h, node, tier)
                    if is_hot(s, node):  # write_through_selective: copy it down now
                        self._finish_plan(h)  # its backup takes host room: the plan so far must stay
                        self._writer.backup(node, to_storage=True)
            done = h.planned_pages
            # Nodes another request is already promoting: wait on its transfer rather than repeating it.
            offset = 0
            for node in s.tree.match(arr).nodes:
                offset += node.num_pages
                if offset <= done:
                    continue
                running = s.inflight.get(PROMOTING, node)
                if node.has_presence() or running is None:
                    break
                h.stages.append(running)
                self._plan(h, node, Tier.STORAGE)
            done = h.planned_pages
            tail = self._tail_keys(s.tree.match(arr), arr, done)
            n = s.store.leading_run(tail) if (s.store is not None and tail) else 0
            if n and not self._promote_range(h, arr, done, done + n, Tier.STORAGE):
                return self._finish_plan(h)
            if h.planned_pages != done + n:
                return self._finish_plan(h)
            rest = tail[n:]
            root = self._root_key(arr)
            self._finish_plan(h)
        if not rest:
            return h
        run = self._remote_run(root, rest)  # network: outside the lock
        if run:
            with s.lock:
                start = h.planned_pages
                if start == done + n:
                    self._promote_range(h, arr, start, start + len(run), Tier.REMOTE, run)
                self._finish_plan(h)
        return h

    def load(self, h: PrefixHandle, policy: Union[str, PrefetchPolicy, None], timeout: Optional[float]) -> LoadResult:
        """Wait for the handle's promotions per policy, then copy its host pages onto the device."""
        s = self.s
        policy = s.config.prefetch_policy if policy is None else parse_enum(PrefetchPolicy, "policy", policy)
        stages = [f for f in h.stages if not f.done()]
        if stages and policy != PrefetchPolicy.BEST_EFFORT:
            limit = None if policy == PrefetchPolicy.WAIT_COMPLETE else (
                s.config.prefetch_timeout_s if timeout is None else timeout)
            wait_futures(stages, timeout=limit)
        for f in h.stages:  # let finished promotions apply their results before we look
            if f.done():
                s.inflight.applied(f)
        loads: List[Future] = []
        with s.lock:
            for node in (s.tree.path_to_root(h.last) if h.last is not None else []):
                if node.device is not None:
                    continue
                running = s.inflight.get(LOADING, node)
                if running is not None:
                    loads.append(running)
                    continue
                if node.host is None:
                    break
                slots = self._evictor.alloc(Tier.DEVICE, node.num_pages)
                if slots is None:
                    break
                loads.append(self._launcher.start_load(node, slots))
        for f in loads:
            try:
                f.result()
            except Exception:
                pass
            s.inflight.applied(f)
        with s.lock:
            parts = []
            for node in (s.tree.path_to_root(h.last) if h.last is not None else []):
                if node.device is None:
                    break
                parts.append(node.device)
        slots: List[int] = np.concatenate(parts).tolist() if parts else []
        pages = len(slots)
        ps = s.config.page_size
        hits: Dict[Tier, int] = {}
        left = pages
        for n, tier in h.plan:
            take = min(n, left)
            if take:
                hits[tier] = hits.get(tier, 0) + take * ps
            left -= take
        s.stats.record_lookup(h.num_tokens, hits)
        return LoadResult(pages, pages * ps, slots, hits)

    def release(self, h: PrefixHandle) -> None:
        s = self.s
        with s.lock:
            for node in h.locked:
                s.tree.unlock(node)
            for node in h.locked:
                s.tree.prune(node)
            h.locked.clear()

    # ======================================================================== internals (lock held)
    def _plan(self, h: PrefixHandle, node: Node, tier: Tier) -> None:
        h.plan.append((node.num_pages, tier))
        h.last = node

    def _finish_plan(self, h: PrefixHandle) -> PrefixHandle:
        if h.last is not None and (not h.locked or h.locked[-1] is not h.last):
            self.s.tree.lock(h.last)
            h.locked.append(h.last)
        return h

    def _tail_keys(self, m: TreeMatch, arr, done_pages: int) -> List[bytes]:
        """Keys of the request's pages from done_pages on (stored ones from the tree, the rest computed)."""
        if self.s.store is None:
            return []  # nothing beyond the memory tiers to look them up in
        keys: List[bytes] = []
        offset = 0
        for node in m.nodes:
            if offset + node.num_pages > done_pages:
                keys.extend(self.s.tree.page_keys(node)[max(0, done_pages - offset):])
            offset += node.num_pages
        if m.num_pages >= done_pages:
            keys.extend(self.s.tree.keys_after(m, arr))
        return keys

    def _root_key(self, arr) -> bytes:
        """Key of the request's page 0: the chain's root, which groups its index records."""
        first = self.s.hasher.chain(arr, num_pages=1)
        return first[0] if first else self.s.hasher.root

    def _remote_run(self, root: bytes, keys: List[bytes]) -> List[PageRecord]:
        publisher = self.s.publisher
        return [] if publisher is None else publisher.remote_run(root, keys)

    def _promote_range(self, h: PrefixHandle, arr, start: int, end: int, source: Tier,
                       records: Optional[List[PageRecord]] = None) -> bool:
        s = self.s
        nodes = s.tree.materialize(arr, start, end)
        chunks = [c for n in nodes for c in s.tree.chunk(n, s.config.promote_chunk_pages)]
        offset = 0
        for chunk in chunks:
            recs = None if records is None else records[offset:offset + chunk.num_pages]
            offset += chunk.num_pages
            if not self._start_promotion(h, [chunk], source, recs):
                return False
        return sum(c.num_pages for c in chunks) == end - start

    def _start_promotion(self, h: PrefixHandle, nodes: List[Node], source: Tier,
                         records: Optional[List[PageRecord]] = None) -> bool:
        s = self.s
        node = nodes[0]
        self._finish_plan(h)  # pin what is planned so far: making host room must not evict it
        slots = self._evictor.alloc(Tier.HOST, node.num_pages)
        if slots is None:
            return False
        s.tree.lock(node)  # locked before the transfer can finish (and prune a node it failed to fill)
        h.locked.append(node)
        h.stages.append(self._launcher.start_promotion(node, slots, source, records))
        self._plan(h, node, source)
        return True
