"""TieredKVCache: the embedded three-tier cache (device, host, tier 3) for one serving node.

The façade owns the lock, wires the parts and owns the one point where finished transfers are
applied (`_apply`). Each part has one job:

    planner.py      match / prefetch / load / release: what is cached where, what to promote (no I/O waits)
    writer.py       placement of new KV, backups device -> host -> storage, the write-back cleaner's pass
    evictor.py      making room in a tier; a victim's last copy staged and written by a transfer
    transfers.py    transfers as objects (Promote, Load, Backup, Write, Spill) and the launcher that starts them
    outcomes.py     what a finished transfer changes, and the follow-up work it asks for (it starts nothing)
    inflight.py     the table of running transfers (not on tree nodes) and the wait for them
    policy.py       the write policy's per-node questions (hot? must a copy outlive eviction?)
    tier3.py        hold hints to tier 3, and what it evicted on its own
    state.py        what the parts share (data only), and who owns each field

Calls between parts go one way (a part is handed the parts below it when the façade makes it):

    façade -> planner -> writer -> evictor -> launcher        façade -> outcomes (results only)
    launcher --(a transfer finished, on its thread)--> façade._apply -> outcomes, then the
        follow-ups: tier 3 hold hints, writer.write_storage (a backup that goes on to tier 3)

Like SGLang's cache controller, a transfer is a small record queued on the transfer engine, and
its acknowledgement is applied in one place: `_apply` reads it (no lock), then under one hold of
the cache lock lets `outcomes` apply it and carries out the follow-up work it returned.

Lock order (a thread holding one may take only those below it):
    1. `state.lock`: the cache lock (an RLock): tree, pools, in-flight node table
    2. the store's own locks, through calls that never wait on I/O (leading_run, exists, hold,
       location, take_dropped), and the prefix index's queue lock (publish/unpublish only enqueue)
    3. leaves: the in-flight completion condition, the transfer engine's depth lock and queues, stats
Never under the cache lock: store.put/get (device I/O, fdatasync), index lookups (network),
waiting on a transfer. The serving thread therefore never waits on the disk while it holds the
lock: an eviction that needs a victim written down stages a copy and lets a transfer write it.
Transfer threads take the cache lock only in `_apply`, once per finished transfer, after the
transfer's I/O is over; the follow-up work it does under the lock only submits (writes) or takes
level-2 locks (hold hints).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Dict, Optional, Sequence, Union

import torch

from radixtier.cache import tier3
from radixtier.cache.config import CacheConfig
from radixtier.cache.evictor import Evictor
from radixtier.cache.handle import LoadResult, MatchResult, PrefixHandle
from radixtier.cache.inflight import LOADING, PROMOTING, InFlight
from radixtier.cache.outcomes import Outcomes, read
from radixtier.cache.planner import Planner
from radixtier.cache.state import CacheState
from radixtier.cache.transfers import Launcher, Transfer
from radixtier.cache.writer import Writer
from radixtier.hashing import KVNamespace, PageHasher, as_token_array
from radixtier.metrics import CacheStats
from radixtier.policies import PrefetchPolicy, WritePolicy
from radixtier.pools import PagePool, resolve_device
from radixtier.storage.api import PageStore, PrefixIndex
from radixtier.storage.publisher import Publisher
from radixtier.tiers import Tier
from radixtier.mover import PageMover
from radixtier.tree import RadixTree, TreeMatch

__all__ = ["CacheConfig", "LoadResult", "MatchResult", "PrefixHandle", "TieredKVCache"]


class TieredKVCache:
    """Three-tier prefix KV cache for one serving node (see module docstring)."""

    def __init__(self, config: CacheConfig, namespace: KVNamespace, store: Optional[PageStore] = None,
                 index: Optional[PrefixIndex] = None) -> None:
        cfg = config.validated()
        if namespace.page_size != cfg.page_size:
            raise ValueError(f"page_size: config says {cfg.page_size} but namespace says {namespace.page_size}")
        if store is not None and store.page_bytes != cfg.page_bytes():
            raise ValueError(f"page_bytes: store pages are {store.page_bytes} bytes, cache pages are "
                             f"{cfg.page_bytes()} bytes (page_shape {cfg.page_shape}, {cfg.dtype})")
        inflight = InFlight()
        hasher = PageHasher(namespace)
        device_pool = PagePool("device", cfg.device_pages, cfg.page_shape, cfg.dtype, resolve_device(cfg.device))
        host_pool = PagePool("host", cfg.host_pages, cfg.page_shape, cfg.dtype, torch.device("cpu"),
                             pin_memory=True)
        stats = CacheStats()
        self._s = s = CacheState(
            config=cfg, namespace=namespace, hasher=hasher,
            tree=RadixTree(hasher, cfg.eviction, busy=inflight.busy, on_split=inflight.on_split),
            device_pool=device_pool, host_pool=host_pool, pools={Tier.DEVICE: device_pool, Tier.HOST: host_pool},
            store=store, publisher=Publisher(store, index) if store is not None else None, stats=stats,
            mover=PageMover(device_pool, host_pool, store, stats, cfg.io_workers), inflight=inflight,
            lock=threading.RLock())
        # the parts, each handed only the parts below it; finished transfers come back to _apply
        launcher = Launcher(s, self._apply)
        self._evictor = Evictor(s, launcher)
        self._writer = Writer(s, self._evictor, launcher)
        self._outcomes = Outcomes(s)
        self._planner = Planner(s, self._writer, self._evictor, launcher)
        self.config, self.namespace, self.hasher, self.store, self.index = cfg, namespace, hasher, store, index
        self.tree, self.device_pool, self.host_pool, self.stats_counters = s.tree, device_pool, host_pool, stats
        self._closed = False
        if store is not None:  # reads into the host pool skip per-I/O page pinning (NvmeofPageStore.register_memory)
            buf = host_pool.buffer
            store.register_memory([(buf.data_ptr(), buf.numel() * buf.element_size())])
        self._metrics_stop: list = []  # serve_metrics(): the sync thread's and the HTTP server's stops
        self._cleaner_wake = threading.Event()
        self._cleaner: Optional[threading.Thread] = None
        if cfg.write_policy == WritePolicy.WRITE_BACK:
            self._cleaner = threading.Thread(target=self._clean_loop, name="radixtier-cleaner", daemon=True)
            self._cleaner.start()

    # ======================================================================== serving API
    def match(self, tokens, beyond_memory: bool = True) -> MatchResult:
        """Longest cached prefix with its per-tier split; starts no transfer and takes no lock on pages.
        beyond_memory=False stops at what the tree knows (no tier-3 or index lookup)."""
        return self._planner.match(tokens, beyond_memory)

    def acquire(self, tokens, policy: Union[str, PrefetchPolicy, None] = None,
                timeout: Optional[float] = None) -> PrefixHandle:
        """Prefetch and load in one call; the caller must release() the handle when done."""
        h = self.prefetch(tokens)
        h.load(policy, timeout)
        return h

    def prefetch(self, tokens) -> PrefixHandle:
        """Lock the cached prefix and start storage/remote -> host promotion in the background."""
        return self._planner.prefetch(tokens)

    def insert(self, tokens, kv_pages: torch.Tensor, first_page: int = 0) -> int:
        """Cache KV for full pages [first_page, first_page + len(kv_pages)); returns pages newly cached."""
        s = self._s
        arr = as_token_array(tokens)
        ps = self.config.page_size
        expected = self.config.page_shape
        if tuple(kv_pages.shape[1:]) != expected:
            raise ValueError(f"kv_pages: expected shape (n, {', '.join(map(str, expected))}), got {tuple(kv_pages.shape)}")
        if first_page < 0:
            raise ValueError(f"first_page: expected >= 0, got {first_page}")
        total = first_page + kv_pages.shape[0]
        if total * ps > arr.size:
            raise ValueError(f"kv_pages: {total} pages need {total * ps} tokens, the request has {arr.size}")
        with s.lock:
            m = s.tree.match(arr[:total * ps])
            # Making room may evict a descendant of the matched path, and pruning that victim
            # must not take the (still empty) nodes this insert is filling or extending. Not a
            # lock: the prefix may still spill down a tier to make room (it stays reachable),
            # where locking it would refuse the insert whenever the memory tiers are tight.
            anchor = m.nodes[-1] if m.nodes else None
            if anchor is not None:
                s.inflight.begin_fill(anchor)
            try:
                added = self._insert_placing(m, arr, kv_pages, first_page, total)
            finally:
                if anchor is not None:
                    s.inflight.end_fill(anchor)
                    s.tree.prune(anchor)
            if self._cleaner is not None and self._writer.needs_cleaning():
                self._cleaner_wake.set()  # only then: a woken cleaner competes for the lock and the GIL
        return added

    def gather(self, device_slots: Sequence[int]) -> torch.Tensor:
        """KV pages at device slots, as one tensor [n, *page_shape] on the device."""
        return self.device_pool.read(device_slots)

    def evict(self, tier: Tier, num_pages: int) -> int:
        """Free at least num_pages slots in a memory tier if unlocked pages allow; returns pages freed."""
        if tier not in self._s.pools:
            raise ValueError(f"evict: tier must be device or host, got {tier!r}")
        with self._s.lock:
            before = self._s.pools[tier].num_free
            self._evictor.reclaim(tier, before + num_pages)
            return self._s.pools[tier].num_free - before

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Wait until every background transfer (and what it chains) has finished."""
        return self._s.inflight.flush(timeout)

    def stats(self) -> Dict[str, object]:
        s = self._s
        snap = s.stats.snapshot()
        with s.lock:
            snap["pages"] = {t.label: s.tree.pages_in(t) for t in (Tier.DEVICE, Tier.HOST, Tier.STORAGE)}
            snap["free_slots"] = {"device": s.device_pool.num_free, "host": s.host_pool.num_free}
            snap["nodes"] = len(s.tree)
        snap["queue_depths"] = s.mover.queue_depths()
        return snap

    def serve_metrics(self, port: int, addr: str = "127.0.0.1", interval_s: float = 1.0) -> None:
        """Expose radixtier: metrics (hits by tier, bytes moved, tier-3 and index state) on
        http://addr:port/metrics, refreshed every interval_s by a background thread, until close()."""
        from radixtier.prometheus import MetricsReporter, PeriodicSync, serve

        s = self._s
        node = self.index.node_id if self.index is not None else "local"
        reporter = MetricsReporter(node, self.store.partition if self.store is not None else 0)

        def sync() -> None:
            reporter.sync_cache(s.stats.snapshot())
            if s.store is not None:
                reporter.sync_store(s.store.stats())
            if s.publisher is not None:
                reporter.sync_index(s.publisher.health())

        sync()
        stop_server = serve(port, addr)
        self._metrics_stop = [PeriodicSync(sync, interval_s).stop, stop_server]

    def close(self) -> None:
        if self._closed:
            return
        for stop in self._metrics_stop:
            stop()
        self._closed = True  # the write-back cleaner stops first, so nothing new starts after the flush
        self._cleaner_wake.set()
        if self._cleaner is not None:
            self._cleaner.join(timeout=5)
        self.flush(timeout=60.0)
        self._s.mover.close()
        if self.store is not None:  # the host pool goes with this cache: the store must not keep it
            self.store.register_memory([])

    def __enter__(self) -> "TieredKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ======================================================================== internals
    def _insert_placing(self, m: TreeMatch, arr, kv_pages: torch.Tensor, first_page: int, total: int) -> int:
        s = self._s
        added = 0
        for node in m.nodes:  # refill structural nodes that lost every copy
            # The node's own page offset, read before placing: placing may chunk it (the node
            # keeps only its tail), so a running sum of num_pages would drift off the request.
            start, n = node.start_page, node.num_pages
            if (not node.has_presence() and s.inflight.get(PROMOTING, node) is None and start >= first_page
                    and s.inflight.get(LOADING, node) is None):
                added += self._writer.place_new(node, kv_pages[start - first_page:start - first_page + n])
        if m.num_pages < first_page:
            return added  # the prefix this KV extends is not cached any more
        node = s.tree.extend(m, arr, total)
        if node is not None:
            got = self._writer.place_new(node, kv_pages[m.num_pages - first_page:])
            if not got:
                s.tree.prune(node)
            added += got
        return added

    def _clean_loop(self) -> None:
        while not self._closed:
            self._cleaner_wake.wait(timeout=0.05)
            self._cleaner_wake.clear()
            if self._closed:
                return
            self._writer.clean_once()

    def _apply(self, op: Transfer, fut: Future) -> None:
        """The one point where a finished transfer is applied (on the thread that finished it).

        Its acknowledgement is read without the lock (the future is done: nothing waits); then,
        under one hold of the cache lock, `outcomes` applies it and the follow-up work it asks
        for is carried out: hold hints to tier 3, and writes to tier 3 (started, not waited on).
        """
        ack = read(op, fut)
        s = self._s
        with s.lock:
            follow = self._outcomes.apply(op, ack)
            for keys in follow.hold:
                tier3.hold(s, keys, True)
            for node in follow.write:
                self._writer.write_storage(node)
