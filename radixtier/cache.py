"""TieredKVCache: the serving-facing cache that ties the tree, the page pools, the mover,
the tier-3 store and the prefix index together.

Policy lives here (what to spill, when to promote, which policy waits how long); the tree
holds state, the mover moves bytes. One lock guards tree and pool state; transfers run
outside it and apply their results under it when they finish, so a failed transfer never
marks a page present and the serving thread never waits on I/O while holding the lock
(except the inline spill, when a tier must give up its last unwritten victim: see _spill_inline).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from radixtier.eviction import EVICTION_MODES, LEAVES_FIRST
from radixtier.hashing import KVNamespace, PageHasher, as_token_array
from radixtier.metrics import CacheStats
from radixtier.mover import TransferEngine
from radixtier.policies import PrefetchPolicy, WritePolicy, parse_enum
from radixtier.pools import PagePool, resolve_device
from radixtier.storage.page_store import PageStore, PutResult
from radixtier.storage.prefix_index import PageRecord, PrefixIndex, store_records
from radixtier.tiers import Tier
from radixtier.tree import Node, RadixTree, TreeMatch

log = logging.getLogger("radixtier.cache")


@dataclass
class CacheConfig:
    """Sizes and policies of one node's tiered cache. `validated()` names any bad field."""

    page_size: int = 16
    page_shape: Tuple[int, ...] = (16,)  # elements of one KV page, e.g. (layers, 2, kv_heads, page_size, head_dim)
    dtype: torch.dtype = torch.float16
    device_pages: int = 256
    host_pages: int = 1024
    device: str = "auto"
    write_policy: Union[str, WritePolicy] = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch_policy: Union[str, PrefetchPolicy] = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 1.0
    promote_chunk_pages: int = 64
    spill_watermark: float = 0.85
    io_workers: int = 4
    eviction: str = LEAVES_FIRST
    # Tell tier 3 which of its pages device/host still hold: those are its first victims, and
    # write_through writes a page back down when the upper tiers let go of it without a copy.
    hold_hints: bool = True

    def validated(self) -> "CacheConfig":
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")

        for name in ("page_size", "device_pages", "host_pages", "write_through_threshold",
                     "promote_chunk_pages", "io_workers"):
            positive_int(name)
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {self.dtype!r}")
        try:
            shape = tuple(int(d) for d in self.page_shape)
        except (TypeError, ValueError):
            raise ValueError(f"page_shape: expected a tuple of positive integers, got {self.page_shape!r}") from None
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"page_shape: expected a tuple of positive integers, got {self.page_shape!r}")
        t = self.prefetch_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise ValueError(f"prefetch_timeout_s: expected a non-negative number, got {t!r}")
        w = self.spill_watermark
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.1 <= w <= 1.0:
            raise ValueError(f"spill_watermark: expected a fraction in [0.1, 1.0], got {w!r}")
        if self.eviction not in EVICTION_MODES:
            raise ValueError(f"eviction: expected one of {', '.join(EVICTION_MODES)}, got {self.eviction!r}")
        resolve_device(self.device)
        return replace(self, page_shape=shape,
                       write_policy=parse_enum(WritePolicy, "write_policy", self.write_policy),
                       prefetch_policy=parse_enum(PrefetchPolicy, "prefetch_policy", self.prefetch_policy))


@dataclass
class MatchResult:
    """Longest cached prefix of a request and which tier holds each part (tokens)."""

    prefix_tokens: int
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    remote_tokens: int = 0

    def by_tier(self) -> Dict[Tier, int]:
        return {Tier.DEVICE: self.device_tokens, Tier.HOST: self.host_tokens,
                Tier.STORAGE: self.storage_tokens, Tier.REMOTE: self.remote_tokens}


@dataclass
class LoadResult:
    """What a request can reuse right now: `num_pages` leading pages, resident at `device_slots`."""

    num_pages: int
    num_tokens: int
    device_slots: List[int]
    hits_by_tier: Dict[Tier, int] = field(default_factory=dict)  # tokens served per source tier


class PrefixHandle:
    """A request's claim on its cached prefix. Pages stay locked (never evicted) until release()."""

    def __init__(self, cache: "TieredKVCache", num_tokens: int) -> None:
        self._cache = cache
        self.num_tokens = num_tokens
        self.locked: List[Node] = []
        self.stages: List[Future] = []  # storage/remote -> host promotions this prefix waits on
        self.plan: List[Tuple[int, Tier]] = []  # (pages, source tier) in prefix order
        self.last: Optional[Node] = None
        self.result: Optional[LoadResult] = None
        self._released = False

    @property
    def planned_pages(self) -> int:
        return sum(p for p, _ in self.plan)

    def load(self, policy: Union[str, PrefetchPolicy, None] = None, timeout: Optional[float] = None) -> LoadResult:
        """Bring the prefix onto the device; storage/remote stages are waited on per `policy`."""
        self.result = self._cache._load(self, policy, timeout)
        return self.result

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self)

    def __enter__(self) -> "PrefixHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class TieredKVCache:
    """Three-tier prefix KV cache for one serving node."""

    def __init__(self, config: CacheConfig, namespace: KVNamespace, store: Optional[PageStore] = None,
                 index: Optional[PrefixIndex] = None) -> None:
        self.config = cfg = config.validated()
        if namespace.page_size != cfg.page_size:
            raise ValueError(f"page_size: config says {cfg.page_size} but namespace says {namespace.page_size}")
        if store is not None:
            page_bytes = _page_bytes(cfg)
            if store.page_bytes != page_bytes:
                raise ValueError(f"page_bytes: store pages are {store.page_bytes} bytes, "
                                 f"cache pages are {page_bytes} bytes (page_shape {cfg.page_shape}, {cfg.dtype})")
        self.namespace = namespace
        self.hasher = PageHasher(namespace)
        self.tree = RadixTree(self.hasher, cfg.eviction)
        device = resolve_device(cfg.device)
        self.device_pool = PagePool("device", cfg.device_pages, cfg.page_shape, cfg.dtype, device)
        self.host_pool = PagePool("host", cfg.host_pages, cfg.page_shape, cfg.dtype, torch.device("cpu"),
                                  pin_memory=True)
        self.pools = {Tier.DEVICE: self.device_pool, Tier.HOST: self.host_pool}
        self.store = store
        self.index = index
        if index is not None and store is not None and hasattr(index, "set_republisher"):
            # after a restart (or a Redis outage) the index is told again what this node's store holds
            index.set_republisher(lambda: store_records(store, index.node_id))
        self.stats_counters = CacheStats()
        self.mover = TransferEngine(self.device_pool, self.host_pool, store, self.stats_counters, cfg.io_workers)
        self._lock = threading.RLock()
        self._inflight: Set[Future] = set()
        self._inflight_cv = threading.Condition(threading.Lock())
        self._closed = False
        self._cleaner_wake = threading.Event()
        self._cleaner = None
        if cfg.write_policy == WritePolicy.WRITE_BACK:
            self._cleaner = threading.Thread(target=self._clean_loop, name="radixtier-cleaner", daemon=True)
            self._cleaner.start()

    # ======================================================================== serving API
    def match(self, tokens, beyond_memory: bool = True) -> MatchResult:
        """Longest cached prefix with its per-tier split; starts no transfer and takes no lock on pages.
        beyond_memory=False stops at what the tree knows (no tier-3 or index lookup): cheap enough
        for the serving path."""
        arr = as_token_array(tokens)
        ps = self.config.page_size
        with self._lock:
            m = self.tree.match(arr)
            up = self.tree.usable_prefix(m)
            res = MatchResult(0)
            res.device_tokens = up.pages_in(Tier.DEVICE) * ps
            res.host_tokens = up.pages_in(Tier.HOST) * ps
            res.storage_tokens = up.pages_in(Tier.STORAGE) * ps
            if not beyond_memory:
                res.prefix_tokens = res.device_tokens + res.host_tokens + res.storage_tokens
                return res
            done = up.num_pages
            tail = self._tail_keys(m, arr, done)
            s = self.store.leading_run(tail) if (self.store is not None and tail) else 0
            res.storage_tokens += s * ps
            root = self._root_key(arr)
        rest = tail[s:]
        if self.index is not None and rest:
            res.remote_tokens = len(self._remote_run(root, rest)) * ps
        res.prefix_tokens = res.device_tokens + res.host_tokens + res.storage_tokens + res.remote_tokens
        return res

    def acquire(self, tokens, policy: Union[str, PrefetchPolicy, None] = None,
                timeout: Optional[float] = None) -> PrefixHandle:
        """Prefetch and load in one call; the caller must release() the handle when done."""
        h = self.prefetch(tokens)
        h.load(policy, timeout)
        return h

    def prefetch(self, tokens) -> PrefixHandle:
        """Lock the cached prefix and start storage/remote -> host promotion in the background."""
        arr = as_token_array(tokens)
        ps = self.config.page_size
        h = PrefixHandle(self, arr.size)
        with self._lock:
            self._learn_storage_evictions()
            m = self.tree.match(arr)
            up = self.tree.usable_prefix(m)
            self.tree.touch(up.nodes)
            for node, tier in zip(up.nodes, up.tiers):
                if tier == Tier.STORAGE and node.pending is not None:
                    # another request is promoting it: wait on that transfer, never read it twice
                    self.tree.lock(node)
                    h.locked.append(node)
                    h.stages.append(node.pending)
                    self._plan(h, node, Tier.STORAGE)
                elif tier == Tier.STORAGE:
                    for chunk in self.tree.chunk(node, self.config.promote_chunk_pages):
                        if not self._start_promotion(h, [chunk], Tier.STORAGE):
                            return self._finish_plan(h)
                else:
                    self._plan(h, node, tier)
                    if self._is_hot(node):  # write_through_selective: copy it down now
                        self._finish_plan(h)  # its backup takes host room: the plan so far must stay
                        self._backup(node, to_storage=True)
            done = h.planned_pages
            # Nodes another request is already promoting: wait on its transfer rather than repeating it.
            offset = 0
            for node in self.tree.match(arr).nodes:
                offset += node.num_pages
                if offset <= done:
                    continue
                if node.has_presence() or node.pending is None:
                    break
                h.stages.append(node.pending)
                self._plan(h, node, Tier.STORAGE)
            done = h.planned_pages
            tail = self._tail_keys(self.tree.match(arr), arr, done)
            s = self.store.leading_run(tail) if (self.store is not None and tail) else 0
            if s and not self._promote_range(h, arr, done, done + s, Tier.STORAGE):
                return self._finish_plan(h)
            if h.planned_pages != done + s:
                return self._finish_plan(h)
            rest = tail[s:]
            root = self._root_key(arr)
            self._finish_plan(h)
        if self.index is None or not rest or self.store is None:
            return h
        run = self._remote_run(root, rest)
        if run:
            with self._lock:
                start = h.planned_pages
                if start == done + s:
                    self._promote_range(h, arr, start, start + len(run), Tier.REMOTE, run)
                self._finish_plan(h)
        return h

    def insert(self, tokens, kv_pages: torch.Tensor, first_page: int = 0) -> int:
        """Cache KV for full pages [first_page, first_page + len(kv_pages)); returns pages newly cached."""
        arr = as_token_array(tokens)
        ps = self.config.page_size
        expected = (self.config.page_shape)
        if tuple(kv_pages.shape[1:]) != expected:
            raise ValueError(f"kv_pages: expected shape (n, {', '.join(map(str, expected))}), got {tuple(kv_pages.shape)}")
        if first_page < 0:
            raise ValueError(f"first_page: expected >= 0, got {first_page}")
        total = first_page + kv_pages.shape[0]
        if total * ps > arr.size:
            raise ValueError(f"kv_pages: {total} pages need {total * ps} tokens, the request has {arr.size}")
        with self._lock:
            m = self.tree.match(arr[:total * ps])
            # Making room may evict a descendant of the matched path, and pruning that victim
            # must not take the (still empty) nodes this insert is filling or extending. Not a
            # lock: the prefix may still spill down a tier to make room (it stays reachable),
            # where locking it would refuse the insert whenever the memory tiers are tight.
            anchor = m.nodes[-1] if m.nodes else None
            if anchor is not None:
                anchor.filling += 1
            try:
                added = self._insert_placing(m, arr, kv_pages, first_page, total)
            finally:
                if anchor is not None:
                    anchor.filling -= 1
                    self.tree.prune(anchor)
        self._cleaner_wake.set()
        return added

    def _insert_placing(self, m: TreeMatch, arr, kv_pages: torch.Tensor, first_page: int, total: int) -> int:
        added = 0
        offset = 0
        for node in m.nodes:  # refill structural nodes that lost every copy
            if (not node.has_presence() and node.pending is None and offset >= first_page
                    and node.loading is None):
                added += self._place_new(node, kv_pages[offset - first_page:offset - first_page + node.num_pages])
            offset += node.num_pages
        if m.num_pages < first_page:
            return added  # the prefix this KV extends is not cached any more
        node = self.tree.extend(m, arr, total)
        if node is not None:
            got = self._place_new(node, kv_pages[m.num_pages - first_page:])
            if not got:
                self.tree.prune(node)
            added += got
        return added

    def gather(self, device_slots: Sequence[int], head_elements: Optional[int] = None) -> torch.Tensor:
        """KV pages at device slots, as one tensor [n, *page_shape] on the device (or only each
        page's first `head_elements`, [n, head_elements], when pages carry more than the model reads)."""
        return self.device_pool.read(device_slots, head_elements)

    def evict(self, tier: Tier, num_pages: int) -> int:
        """Free at least num_pages slots in a memory tier if unlocked pages allow; returns pages freed."""
        if tier not in self.pools:
            raise ValueError(f"evict: tier must be device or host, got {tier!r}")
        with self._lock:
            before = self.pools[tier].num_free
            self._reclaim(tier, before + num_pages)
            return self.pools[tier].num_free - before

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Wait until every background transfer (and what it chains) has finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._inflight_cv:
                pending = list(self._inflight)
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            wait_futures(pending, timeout=left)
            with self._inflight_cv:  # let completion callbacks run their bookkeeping
                self._inflight_cv.wait_for(lambda: not (set(pending) & self._inflight), timeout=0.5)

    def stats(self) -> Dict[str, object]:
        snap = self.stats_counters.snapshot()
        with self._lock:
            snap["pages"] = {t.label: self.tree.pages_in(t) for t in (Tier.DEVICE, Tier.HOST, Tier.STORAGE)}
            snap["free_slots"] = {"device": self.device_pool.num_free, "host": self.host_pool.num_free}
            snap["nodes"] = len(self.tree)
        snap["queue_depths"] = self.mover.queue_depths()
        return snap

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # the write-back cleaner stops first, so nothing new starts after the flush
        self._cleaner_wake.set()
        if self._cleaner is not None:
            self._cleaner.join(timeout=5)
        self.flush(timeout=60.0)
        self.mover.close()

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ======================================================================== planning
    def _plan(self, h: PrefixHandle, node: Node, tier: Tier) -> None:
        h.plan.append((node.num_pages, tier))
        h.last = node

    def _finish_plan(self, h: PrefixHandle) -> PrefixHandle:
        if h.last is not None and (not h.locked or h.locked[-1] is not h.last):
            self.tree.lock(h.last)
            h.locked.append(h.last)
        return h

    def _tail_keys(self, m: TreeMatch, arr, done_pages: int) -> List[bytes]:
        """Keys of the request's pages from done_pages on (stored ones from the tree, the rest computed)."""
        if self.store is None and self.index is None:
            return []  # nothing beyond the memory tiers to look them up in
        keys: List[bytes] = []
        offset = 0
        for node in m.nodes:
            if offset + node.num_pages > done_pages:
                keys.extend(node.keys[max(0, done_pages - offset):])
            offset += node.num_pages
        if m.num_pages >= done_pages:
            keys.extend(self.tree.keys_after(m, arr))
        return keys

    def _root_key(self, arr) -> bytes:
        """Key of the request's page 0: the chain's root, which groups its index records."""
        first = self.hasher.chain(arr, num_pages=1)
        return first[0] if first else self.hasher.root

    def _remote_run(self, root: bytes, keys: List[bytes]) -> List[PageRecord]:
        """Leading pages other nodes hold in our shared namespace (the index may be down: then none)."""
        try:
            runs = self.index.lookup(root, keys)  # type: ignore[union-attr]
        except Exception as exc:  # the index must never break serving
            log.warning("prefix index lookup failed, serving from local tiers: %s", exc)
            return []
        usable: List[PageRecord] = []
        for recs in runs:
            rec = next((r for r in recs if self.store is not None and r.tier == Tier.STORAGE.label
                        and r.location.namespace == self.store.uuid), None)
            if rec is None:
                break
            usable.append(rec)
        return usable

    def _promote_range(self, h: PrefixHandle, arr, start: int, end: int, source: Tier,
                       records: Optional[List[PageRecord]] = None) -> bool:
        nodes = self.tree.materialize(arr, start, end)
        chunks = [c for n in nodes for c in self.tree.chunk(n, self.config.promote_chunk_pages)]
        offset = 0
        for chunk in chunks:
            recs = None if records is None else records[offset:offset + chunk.num_pages]
            offset += chunk.num_pages
            if not self._start_promotion(h, [chunk], source, recs):
                return False
        return sum(c.num_pages for c in chunks) == end - start

    def _start_promotion(self, h: PrefixHandle, nodes: List[Node], source: Tier,
                         records: Optional[List[PageRecord]] = None) -> bool:
        node = nodes[0]
        self._finish_plan(h)  # pin what is planned so far: making host room must not evict it
        slots = self._alloc(Tier.HOST, node.num_pages)
        if slots is None:
            return False
        keys = list(node.keys)
        self.tree.lock(node)  # locked before the transfer can finish (and prune a node it failed to fill)
        h.locked.append(node)
        if source == Tier.STORAGE:
            fut = self.mover.storage_to_host(keys, slots)
        else:
            fut = self.mover.remote_to_host([r.location for r in records], keys, slots)  # type: ignore[union-attr]
        node.pending = fut
        self._track(fut, lambda f: self._on_promoted(f, keys, slots, source))
        h.stages.append(fut)
        self._plan(h, node, source)
        return True

    # ======================================================================== loading
    def _load(self, h: PrefixHandle, policy, timeout: Optional[float]) -> LoadResult:
        policy = self.config.prefetch_policy if policy is None else parse_enum(PrefetchPolicy, "policy", policy)
        stages = [f for f in h.stages if not f.done()]
        if stages and policy != PrefetchPolicy.BEST_EFFORT:
            limit = None if policy == PrefetchPolicy.WAIT_COMPLETE else (
                self.config.prefetch_timeout_s if timeout is None else timeout)
            wait_futures(stages, timeout=limit)
        for f in h.stages:  # let finished promotions apply their results before we look
            if f.done():
                self._wait_applied(f)
        loads: List[Future] = []
        with self._lock:
            path = self.tree.path_to_root(h.last) if h.last is not None else []
            for node in path:
                if node.device is not None:
                    continue
                if node.loading is not None:
                    loads.append(node.loading)
                    continue
                if node.host is None:
                    break
                slots = self._alloc(Tier.DEVICE, node.num_pages)
                if slots is None:
                    break
                fut = self.mover.host_to_device(list(node.host), slots)
                node.loading = fut
                self._track(fut, lambda f, k=list(node.keys), s=slots: self._on_loaded(f, k, s))
                loads.append(fut)
        for f in loads:
            try:
                f.result()
            except Exception:
                pass
            self._wait_applied(f)
        with self._lock:
            path = self.tree.path_to_root(h.last) if h.last is not None else []
            slots: List[int] = []
            for node in path:
                if node.device is None:
                    break
                slots.extend(node.device)
        pages = len(slots)
        ps = self.config.page_size
        hits: Dict[Tier, int] = {}
        left = pages
        for n, tier in h.plan:
            take = min(n, left)
            if take:
                hits[tier] = hits.get(tier, 0) + take * ps
            left -= take
        self.stats_counters.record_lookup(h.num_tokens, hits)
        return LoadResult(pages, pages * ps, slots, hits)

    def _release(self, h: PrefixHandle) -> None:
        with self._lock:
            for node in h.locked:
                self.tree.unlock(node)
            for node in h.locked:
                self.tree.prune(node)
            h.locked.clear()

    # ======================================================================== transfers done
    def _track(self, fut: Future, on_done) -> None:
        with self._inflight_cv:
            self._inflight.add(fut)

        def done(f: Future) -> None:
            try:
                on_done(f)
            except Exception:  # pragma: no cover - a bookkeeping bug must not kill the worker silently
                log.exception("radixtier: transfer completion failed")
            finally:
                with self._inflight_cv:
                    self._inflight.discard(f)
                    self._inflight_cv.notify_all()

        fut.add_done_callback(done)

    def _wait_applied(self, fut: Future) -> None:
        with self._inflight_cv:
            self._inflight_cv.wait_for(lambda: fut not in self._inflight, timeout=30)

    @staticmethod
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

    def _nodes_of(self, keys: Sequence[bytes]) -> List[Tuple[Node, int, int]]:
        """(node, first index into keys, count) groups: a transfer's pages may span nodes split meanwhile."""
        groups: List[Tuple[Node, int, int]] = []
        for i, key in enumerate(keys):
            hit = self.tree.node_of_key(key)
            if hit is None:
                continue
            node = hit[0]
            if groups and groups[-1][0] is node:
                groups[-1] = (node, groups[-1][1], groups[-1][2] + 1)
            else:
                groups.append((node, i, 1))
        return groups

    def _on_promoted(self, fut: Future, keys: List[bytes], slots: List[int], source: Tier) -> None:
        ok = self._outcome(fut, len(keys))
        good = next((i for i, v in enumerate(ok) if not v), len(keys))  # pages after a miss are no prefix
        with self._lock:
            # a miss on a page that meanwhile reached host another way (tier 3 may evict the pages a
            # faster tier holds first) lost nothing; only the others are failed transfers
            lost = sum(1 for k in keys[good:] if (hit := self.tree.node_of_key(k)) is None or hit[0].host is None)
            if lost:
                self.stats_counters.record_failure(f"{source.label}_to_host", lost)
            used: Set[int] = set()
            for node, i, n in self._nodes_of(keys):
                if node.pending is fut:
                    node.pending = None
                keep = max(0, min(n, good - i))
                if keep and keep < n:
                    node = self.tree.split(node, keep)
                if keep and node.host is None:
                    self.tree.set_slots(node, Tier.HOST, slots[i:i + keep])
                    used.update(range(i, i + keep))
                    if source == Tier.STORAGE:
                        self.tree.set_storage_pages(node, node.num_pages)
                        self._hold(node.keys, True)
                if keep < n and source == Tier.STORAGE:
                    # the store proved these pages absent or corrupt (it freed them): drop the claim
                    hit = self.tree.node_of_key(keys[i + keep])
                    if hit is not None:
                        self.tree.set_storage_pages(hit[0], min(hit[0].storage_pages, hit[1]))
            self.host_pool.free([s for j, s in enumerate(slots) if j not in used])
            for key in keys:
                hit = self.tree.node_of_key(key)
                if hit is not None:
                    self.tree.prune(hit[0])

    def _on_loaded(self, fut: Future, keys: List[bytes], slots: List[int]) -> None:
        ok = all(self._outcome(fut, len(slots)))
        with self._lock:
            self._adopt(fut, keys, slots, Tier.DEVICE, "loading", ok)

    def _adopt(self, fut: Future, keys: List[bytes], slots: List[int], tier: Tier, inflight: str,
               ok: bool) -> List[Tuple[Node, int, int]]:
        """A copy into `tier` finished: give each node its slots, free the rest, clear the in-flight mark."""
        groups = self._nodes_of(keys)
        used: Set[int] = set()
        for node, i, n in groups:
            if getattr(node, inflight) is fut:
                setattr(node, inflight, None)
            if ok and node.slots(tier) is None and n == node.num_pages:
                self.tree.set_slots(node, tier, slots[i:i + n])
                used.update(range(i, i + n))
        self.pools[tier].free([s for j, s in enumerate(slots) if j not in used])
        return groups

    # ======================================================================== write paths
    def _place_new(self, node: Node, kv: torch.Tensor) -> int:
        """Cache new KV in the fastest tier with room, chunk by chunk; returns pages placed.

        A run longer than the device pool still gets cached: chunks that find no device slot go
        to host memory (and on to storage under write-through). A chunk that fits nowhere ends
        the run, and what follows it is dropped (it could never be a prefix hit).
        """
        placed = 0
        chunks = self.tree.chunk(node, self.config.promote_chunk_pages)
        for i, chunk in enumerate(chunks):
            part = kv[placed:placed + chunk.num_pages]
            if not self._place_chunk(chunk, part):
                for rest in reversed(chunks[i:]):
                    self.tree.prune(rest)
                break
            placed += chunk.num_pages
        return placed

    def _place_chunk(self, node: Node, kv: torch.Tensor) -> bool:
        write_through = self.config.write_policy == WritePolicy.WRITE_THROUGH
        slots = self._alloc(Tier.DEVICE, node.num_pages)
        if slots is not None:
            self.device_pool.write(slots, kv)
            self.tree.set_slots(node, Tier.DEVICE, slots)
            if write_through:
                self._backup(node, to_storage=True)
            return True
        slots = self._alloc(Tier.HOST, node.num_pages)
        if slots is None:
            return False
        self.host_pool.write(slots, kv)
        self.tree.set_slots(node, Tier.HOST, slots)
        if write_through:
            self._write_storage(node)
        return True

    def _is_hot(self, node: Node) -> bool:
        return (self.config.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE
                and node.hits >= self.config.write_through_threshold)

    def _backup(self, node: Node, to_storage: bool) -> None:
        """Copy a node down (device -> host, then host -> storage) in the background."""
        if node.host is None:
            if node.device is None or node.backing is not None:
                return
            slots = self._alloc(Tier.HOST, node.num_pages)
            if slots is None:
                return
            self.tree.lock(node)  # the source pages must not move while they are read
            fut = self.mover.device_to_host(list(node.device), slots)
            node.backing = fut
            keys = list(node.keys)
            self._track(fut, lambda f: self._on_backed_up(f, node, keys, slots, to_storage))
        elif to_storage:
            self._write_storage(node)

    def _on_backed_up(self, fut: Future, node: Node, keys: List[bytes], slots: List[int], to_storage: bool) -> None:
        ok = all(self._outcome(fut, len(slots)))
        with self._lock:
            self.tree.unlock(node)
            groups = self._adopt(fut, keys, slots, Tier.HOST, "backing", ok)
            if ok and to_storage:
                for n_, _, _ in groups:
                    self._write_storage(n_)

    def _parents(self, node: Node) -> List[Optional[bytes]]:
        first = node.parent.keys[-1] if node.parent is not None and node.parent.keys else None
        return [first] + list(node.keys[:-1])

    def _write_storage(self, node: Node) -> None:
        if self.store is None or node.host is None or node.in_storage or node.writing is not None:
            return
        self.tree.lock(node)
        keys = list(node.keys)
        fut = self.mover.host_to_storage(list(node.host), keys, self._parents(node))
        node.writing = fut
        self._track(fut, lambda f: self._on_written(f, node, keys))

    def _on_written(self, fut: Future, node: Node, keys: List[bytes]) -> None:
        ok = self._outcome(fut, len(keys))
        evicted = fut.result().evicted if (fut.exception() is None and isinstance(fut.result(), PutResult)) else []
        with self._lock:
            self.tree.unlock(node)
            self._apply_storage(keys, ok, evicted)
            for n_, _, _ in self._nodes_of(keys):
                if n_.writing is fut:
                    n_.writing = None
            self.tree.prune(node)

    def _apply_storage(self, keys: List[bytes], ok: List[bool], evicted: List[bytes]) -> None:
        """Record pages the store now holds; drop claims for pages it evicted; tell the index."""
        for key in evicted:
            self.tree.storage_evicted(key)
        if evicted:
            self.stats_counters.record_eviction(Tier.STORAGE, len(evicted))
        for n_, i, n in self._nodes_of(keys):
            run = 0
            while run < n and ok[i + run]:
                run += 1
            self.tree.set_storage_pages(n_, max(n_.storage_pages, run))
            if run and (n_.device is not None or n_.host is not None):
                self._hold(n_.keys[:run], True)
        if self.index is not None:
            self._publish(keys, ok, evicted)

    def _publish(self, keys: List[bytes], ok: List[bool], evicted: List[bytes]) -> None:
        try:
            if evicted:
                self.index.unpublish(evicted)  # type: ignore[union-attr]
            good = [k for k, v in zip(keys, ok) if v]
            if not good:
                return
            hit = self.tree.node_of_key(good[0])
            root = self.tree.path_to_root(hit[0])[0].keys[0] if hit else good[0]  # the chain's page 0
            recs, pub = [], []
            for k in good:
                loc = self.store.location(k)  # type: ignore[union-attr]
                if loc is not None:
                    pub.append(k)
                    recs.append(PageRecord(self.index.node_id, Tier.STORAGE.label, loc))  # type: ignore[union-attr]
            if pub:
                self.index.publish(root, pub, recs)  # type: ignore[union-attr]
        except Exception as exc:  # the index is advisory: serving goes on without it
            log.warning("prefix index publish failed: %s", exc)

    # ======================================================================== eviction
    def _alloc(self, tier: Tier, n: int) -> Optional[List[int]]:
        pool = self.pools[tier]
        slots = pool.try_alloc(n)
        if slots is None and n <= pool.num_pages and self._reclaim(tier, n):
            slots = pool.try_alloc(n)
        return slots

    def _reclaim(self, tier: Tier, need_free: int) -> bool:
        pool = self.pools[tier]
        self._learn_storage_evictions()  # what leaves a tier must know whether tier 3 still has it
        while pool.num_free < need_free:
            victim = self.tree.peek_victim(tier)
            if victim is None:
                return False
            self._evict_node(victim, tier)
        return True

    def _learn_storage_evictions(self) -> None:
        """Apply what tier 3 dropped since the last look (evictions made for other writers, pages it
        found corrupt) before planning reads from it, so a plan rarely names a page already gone."""
        take = getattr(self.store, "take_evicted", None)
        gone = take() if take is not None else []
        if gone:
            for key, present in zip(gone, self.store.exists(gone)):  # type: ignore[union-attr]
                if not present:
                    self.tree.storage_evicted(key)

    def _hold(self, keys: Sequence[bytes], held: bool) -> None:
        if self.config.hold_hints and self.store is not None and keys:
            self.store.hold(keys, held)

    def _write_down(self, node: Node) -> bool:
        """write_through with hold hints: tier 3 may have let go of a page while we held it; the
        last upper-tier copy is not dropped without writing it back down."""
        return (self.config.hold_hints and self.store is not None and not node.in_storage
                and self.config.write_policy == WritePolicy.WRITE_THROUGH)

    def _evict_node(self, node: Node, tier: Tier) -> None:
        policy = self.config.write_policy
        if tier == Tier.DEVICE:
            if node.host is None and (policy == WritePolicy.WRITE_BACK or self._is_hot(node) or self._write_down(node)):
                slots = self._alloc(Tier.HOST, node.num_pages)
                if slots is not None:  # inline spill: no clean victim was left
                    try:
                        self.mover.copy_now(self.device_pool, node.device, self.host_pool, slots)
                    except Exception as exc:  # the page is dropped (a later miss), never half-copied
                        log.warning("radixtier: inline device->host spill failed: %s", exc)
                        self.stats_counters.record_failure("device_to_host", node.num_pages)
                        self.host_pool.free(slots)
                    else:
                        self.tree.set_slots(node, Tier.HOST, slots)
        elif tier == Tier.HOST:
            if (self.store is not None and not node.in_storage and node.writing is None
                    and (policy == WritePolicy.WRITE_BACK or self._is_hot(node) or self._write_down(node))):
                self._spill_inline(node)
        freed = self.tree.clear_slots(node, tier)
        self.pools[tier].free(freed)
        self.stats_counters.record_eviction(tier, len(freed))
        if node.device is None and node.host is None:
            self._hold(node.keys, False)  # tier 3 has the only copy now (if it has one)
        self.tree.prune(node)

    def _spill_inline(self, node: Node) -> None:
        """Write a host victim down synchronously. It blocks the caller under the lock, which is
        why write_back's cleaner keeps the LRU end clean; it runs only when no clean victim is left."""
        keys = list(node.keys)
        try:
            res = self.store.put(keys, [self.host_pool.page(s) for s in node.host], self._parents(node))  # type: ignore[union-attr]
        except Exception as exc:  # the page leaves the cache (a later miss); serving goes on
            log.warning("radixtier: inline host->storage spill failed: %s", exc)
            self.stats_counters.record_failure("host_to_storage", len(keys))
            return
        self.stats_counters.record_move("host_to_storage", sum(res.ok), sum(res.ok) * self.host_pool.page_bytes)
        self._apply_storage(keys, res.ok, res.evicted)

    def _clean_loop(self) -> None:
        """write_back: keep the LRU end of each tier clean, so evictions rarely wait on a copy."""
        while not self._closed:
            self._cleaner_wake.wait(timeout=0.05)
            self._cleaner_wake.clear()
            if self._closed:
                return
            with self._lock:
                for tier in (Tier.DEVICE, Tier.HOST):
                    pool = self.pools[tier]
                    if pool.num_used <= self.config.spill_watermark * pool.num_pages:
                        continue
                    budget = pool.num_used - (self.config.spill_watermark - 0.1) * pool.num_pages
                    for node in self.tree.victims(tier, 64):
                        if budget <= 0:
                            break
                        if tier == Tier.DEVICE and node.host is None and node.backing is None:
                            self._backup(node, to_storage=False)
                        elif tier == Tier.HOST and not node.in_storage:
                            self._write_storage(node)
                        budget -= node.num_pages


def _page_bytes(cfg: CacheConfig) -> int:
    n = 1
    for d in cfg.page_shape:
        n *= int(d)
    return n * torch.empty((), dtype=cfg.dtype).element_size()
