"""RadixTierStorage: radixtier's NVMe-oF page store and prefix index as an SGLang HiCache L3 backend.

SGLang hands us page-hash keys and host-pool slots; we turn them into store keys for this
rank (keys.py), read and write the host pool's own memory (zero copy through
`get_page_buffer_meta`), and keep each page's parent, from `extra_info.prefix_keys`, so the
store evicts leaves first along SGLang's hash chains. Pages other nodes wrote into the same
namespace are found through the prefix index and read by verified slot location.

Nothing here raises into SGLang's transfer threads: a failure is a miss (logged). A read
reports a page loaded only after its slot header and checksum proved it. host_indices are
checked against the registered pool before they become addresses: a slot outside it, or a
page that is not whole and aligned, fails the whole call (one rate-limited log line) with
nothing read or written. One exception to "a failure is a miss": `keys` (or `transfers`)
that are not a list raise ValueError naming the argument, since a per-key result needs a
length (SGLang always passes lists). `batch_exists` trusts the index for other nodes' pages
without reading them (a lookup must stay one round trip), so a stale record can be counted
there; the read that follows then misses, and SGLang recomputes that page, never uses wrong
bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo,
                                                  PoolHitPolicy, PoolTransfer, PoolTransferResult)

from radixtier.integrations.sglang.backend.arguments import (ArgumentError, RefusalLog, check_host_indices, host_tensor,
                                                     require_keys)
from radixtier.integrations.sglang.backend.attach import index_node_id, open_index, open_partition
from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError, shown_size
from radixtier.integrations.sglang.backend.counters import BackendCounters
from radixtier.integrations.sglang.backend.diagnosis import already_stored_cause, prefetch_policy
from radixtier.integrations.sglang.events.link import EventsLink
from radixtier.integrations.sglang.backend.host_pools import host_regions, pool_format, pool_slots
from radixtier.integrations.sglang.backend.keys import KV_POOL, Chain, KeyMapper, PoolFormat, RankIdentity, leading_true
from radixtier.prometheus import MetricsReporter
from radixtier.storage.api import PageSegments, RouterTag
from radixtier.storage.client import TierClient

log = logging.getLogger("radixtier.sglang")

V1, FLAT = "v1", "flat"


class RadixTierStorage(HiCacheStorage):
    """SGLang HiCache storage backend (see module docstring); built by StorageBackendFactory('dynamic')."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[Dict[str, Any]] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = BackendConfig.from_extra_config(extra)
        self.storage_config = storage_config
        self.rank = RankIdentity.from_storage_config(storage_config)
        if self.rank.is_mla and self.rank.tp_size > 1 and not self.config.redis_url:
            raise ConfigError("redis_url: required for an MLA model with tp_size > 1: only the storage writer "
                              "rank writes the shared KV, and the other ranks find it through the index")
        self.keys = KeyMapper(self.rank)
        self.kv_interface = V1 if bool(extra.get("interface_v1", 0)) else FLAT
        self.mem_pool_host = None
        self.registered_pools: Dict[str, Any] = {}
        self._formats: Dict[str, PoolFormat] = {}
        self._open_lock = threading.Lock()
        self._client: Optional[TierClient] = None  # tier 3 and the index, once the store is open
        self._prom: Optional[MetricsReporter] = None  # radixtier: metrics, when SGLang's metrics are on
        self._events: Optional[EventsLink] = None  # tier-3 KV events (events_link.py), from the store's open
        self._closed = False
        self._stats = BackendCounters()
        self._refusals = RefusalLog()
        self.node_id = index_node_id(self.config.node_id, self.rank.rank_index(), self.rank.is_sole_rank())
        self._warned_no_prefix = False
        self._warned_already_stored = False
        log.info("radixtier: HiCache backend for %s rank %d (tp %d/%d, pp %d/%d, dp %d%s) on %s, index %s as %s",
                 self.rank.model or "model", self.rank.rank_index(), self.rank.tp_rank, self.rank.tp_size,
                 self.rank.pp_rank, self.rank.pp_size, self.rank.dp_rank, ", MLA" if self.rank.is_mla else "",
                 self.config.path, self.config.redis_url or "in-process", self.node_id)
        if self.config.redis_url and self.kv_interface == FLAT:
            self._warn_no_prefix("interface_v1 is off: SGLang's legacy batch_set sends no prefix keys")

    # ---------------------------------------------------------------- host pools
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        self._formats[KV_POOL] = pool_format(KV_POOL, mem_pool_host)
        if self._client is not None:  # a pool arriving after the store opened is registered too
            self._register_host_memory(self._client.store)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        name = str(host_pool_name)
        self.registered_pools[name] = host_pool
        self._formats[name] = pool_format(name, host_pool)
        if self._client is not None:
            self._register_host_memory(self._client.store)

    def on_host_pools_registered(self) -> None:
        self._ensure_open()  # fail the attach now (bad path, page size, partition), not on the first read

    @property
    def store(self):
        return self._ensure_open().store

    @property
    def index(self):
        return self._ensure_open().index

    def _ensure_open(self) -> TierClient:
        client = self._client
        if client is not None:
            return client
        with self._open_lock:
            if self._closed:
                raise RuntimeError("radixtier: backend is closed")
            if self._client is None:
                if not self._formats:
                    raise RuntimeError("radixtier: no host pool registered yet (register_mem_pool_host)")
                need = self.config.page_bytes or max(f.page_bytes for f in self._formats.values())
                too_big = [f for f in self._formats.values() if f.page_bytes > need]
                if too_big:
                    raise ConfigError(f"page_bytes: {need} is smaller than a page of pool {too_big[0].pool!r} "
                                      f"({too_big[0].page_bytes} bytes)")
                created = not os.path.exists(self.config.path)
                store = self._open_partition(need)
                try:
                    index = open_index(self.config, store, self.node_id)
                except BaseException:
                    store.close()
                    if created and os.path.isfile(self.config.path):  # a failed start leaves nothing behind
                        os.unlink(self.config.path)
                    raise
                if self.storage_config.enable_storage_metrics:  # SGLang's --enable-metrics
                    # created here, in the scheduler process, after SGLang set PROMETHEUS_MULTIPROC_DIR
                    self._prom = MetricsReporter(self.node_id, store.partition, self.rank.rank_index())
                self._events = EventsLink(self.config, self.rank, self._block_size, store.router_tags)
                self._register_host_memory(store)
                self._client = TierClient(store, index)
                log.info("radixtier: %s partition %d open: %d/%d pages, io %s, O_DIRECT %s", self.config.path,
                         store.partition, len(store), store.capacity_pages, store.io_engine, store.direct)
        return self._client

    def _block_size(self) -> int:
        return int(getattr(self.mem_pool_host, "page_size", 1) or 1)  # SGLang's pool attribute: tokens a page

    def _open_partition(self, page_bytes: int):
        """This rank's partition; a capacity under the free space (check_room passed) but past the
        filesystem's largest file (ext4: 16 TiB) fails creation with EFBIG: said as a capacity error."""
        try:
            return open_partition(self.config, page_bytes, self.rank.rank_index(), self.node_id)
        except OSError as exc:
            if exc.errno != errno.EFBIG:
                raise
            raise ConfigError(f"capacity: expected a size the filesystem holding {self.config.path} can hold "
                              f"({exc.strerror}), got {shown_size(self.config.capacity)}") from None

    def _register_host_memory(self, store) -> None:
        """The host pools' memory as io_uring fixed buffers, so reads into them skip per-I/O page
        pinning (see NvmeofPageStore.register_memory); a refusal is logged and changes nothing else."""
        pools = [self.mem_pool_host] + list(self.registered_pools.values())
        regions = host_regions(p for p in pools if p is not None)
        if regions:
            t0 = time.perf_counter()
            ok = store.register_memory(regions)
            log.info("radixtier: host pools (%d MiB) %s as io_uring fixed buffers in %.2f s",
                     sum(n for _a, n in regions) >> 20, "registered" if ok else "not registered",
                     time.perf_counter() - t0)

    def _format(self, pool: str) -> PoolFormat:
        fmt = self._formats.get(pool)
        if fmt is None:
            raise KeyError(f"pool {pool!r} is not registered with the radixtier backend")
        return fmt

    def _pool(self, name: str):
        if name == KV_POOL and name not in self.registered_pools:
            return self.mem_pool_host
        return self.registered_pools[name]

    # ---------------------------------------------------------------- v1: zero copy
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        require_keys(keys)
        return self._guard("batch_get_v1", len(keys), lambda: self._get_pool_pages(
            KV_POOL, self.mem_pool_host, keys, host_indices, self._prefix_keys(extra_info), V1))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        require_keys(keys)
        return self._guard("batch_set_v1", len(keys), lambda: self._set_pool_pages(
            KV_POOL, self.mem_pool_host, keys, host_indices, self._prefix_keys(extra_info), V1))

    # ---------------------------------------------------------------- legacy: flat pages
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        out = self.batch_get([key], [target_location])
        return out[0] if out else None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        require_keys(keys)
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            log.error("radixtier: batch_get needs one target tensor per key (%d keys)", len(keys))
            return [None] * len(keys)

        def run():
            chain = self.keys.chain(keys, None, self._format(KV_POOL), FLAT, for_read=True)
            ok = self._read(chain, [host_tensor(t, target=True) for t in target_locations])
            return ok
        ok = self._guard("batch_get", len(keys), run)
        return [t if good else None for t, good in zip(target_locations, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        require_keys(keys)
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            log.error("radixtier: batch_set needs one value tensor per key (%d keys)", len(keys))
            return False

        def run():
            if not self.rank.writes(KV_POOL):
                return self._skip_not_writer(len(keys))
            chain = self.keys.chain(keys, None, self._format(KV_POOL), FLAT)
            chain.parents = [None] * len(keys)  # a legacy batch is not promised to be one chain
            tags = None if self._events is None else self._events.tags_for(keys, None, chained=False)
            ok = self._write(KV_POOL, chain, [host_tensor(v) for v in values], tags)
            if self._events is not None:
                self._events.stored(keys, None, chain.keys, ok, chained=False)
            return ok
        return all(self._guard("batch_set", len(keys), run))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Leading run of pages held here or, through the index, by another node in this namespace."""
        require_keys(keys)
        if not keys:
            return 0

        def run():
            chain = self.keys.chain(keys, _prefix(extra_info), self._format(KV_POOL), self.kv_interface,
                                    for_read=True)
            return [self._leading_run(chain)]
        return self._guard("batch_exists", 1, run, failed=0)[0]

    # ---------------------------------------------------------------- v2: sidecar pools
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        require_keys(keys)

        def run():
            kv_pages = self.batch_exists(keys, extra_info)
            hits: Dict[str, int] = {str(KV_POOL): kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                name = str(t.name)
                chain = self.keys.chain(keys[:kv_pages], _prefix(extra_info), self._format(name),
                                        self._interface_of(name), for_read=True)
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    have = self._sidecar_have(chain, from_end=False)
                    boundary = leading_true(have)
                    ok_lengths = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    have = self._sidecar_have(chain, from_end=True)
                    window = max(1, len(t.keys) if t.keys else 1)
                    ok_lengths = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window):n])}
                    boundary = max(ok_lengths, default=0)
                else:  # a pool kind this backend does not know how to gate: report none of it, never guess
                    log.warning("radixtier: pool %s: hit policy %s not supported; reporting no pages", name,
                                t.hit_policy)
                    continue
                if boundary:
                    hits[name] = boundary
                restorable = [n for n in restorable if n in ok_lengths]
            return [PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)]
        return self._guard("batch_exists_v2", 1, run, failed=PoolTransferResult.empty())[0]

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._each_pool("batch_get_v2", transfers, extra_info, self._get_pool_pages)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> Dict[str, List[bool]]:
        return self._each_pool("batch_set_v2", transfers, extra_info, self._set_pool_pages)

    def _each_pool(self, op: str, transfers: List[PoolTransfer], extra_info, fn) -> Dict[str, List[bool]]:
        """One guarded call per pool: a pool holding every page of the prefix continues the KV
        chain; a trailing window starts its own (its prefix pages are not in that pool)."""
        if not isinstance(transfers, (list, tuple)):
            raise ValueError(f"transfers: expected a list of PoolTransfer, got {type(transfers).__name__}")
        out: Dict[str, List[bool]] = {}
        for i, t in enumerate(transfers):
            name, keys = str(t.name), [] if t.keys is None else t.keys  # keys None: nothing to move for this pool
            require_keys(keys, f"transfers[{i}].keys")
            out[name] = self._guard(f"{op}[{name}]", len(keys), lambda name=name, keys=keys, t=t: fn(
                name, self._pool(name), keys, t.host_indices, self._prefix_keys(extra_info),
                self._interface_of(name), t.hit_policy == PoolHitPolicy.ALL_PAGES))
        return out

    def _interface_of(self, pool_name: str) -> str:
        """KV: what SGLang calls (interface_v1); sidecars: zero copy where registration's probe worked."""
        if pool_name == KV_POOL:
            return self.kv_interface
        return V1 if self._format(pool_name).zero_copy else FLAT

    # ---------------------------------------------------------------- the work
    def _page_buffers(self, name: str, pool, host_indices: torch.Tensor, pages: int, interface: str,
                      for_read: bool):
        page_size = int(getattr(pool, "page_size", 1) or 1)
        flat = check_host_indices(host_indices, pages, page_size, pool_slots(name, pool), name)
        if interface == V1:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
            return PageSegments(ptrs, sizes, pages), None
        starts = flat[::page_size].tolist()
        if for_read:
            bufs = [pool.get_dummy_flat_data_page() for _ in range(pages)]
            return bufs, starts
        return [host_tensor(pool.get_data_page(s, flat=True)) for s in starts], None

    def _get_pool_pages(self, name: str, pool, keys: Sequence[str], host_indices, prefix, interface: str,
                        continues: bool = True) -> List[bool]:
        if not keys:
            return []
        if pool is None:
            raise RuntimeError("no host pool registered")
        bufs, starts = self._page_buffers(name, pool, host_indices, len(keys), interface, for_read=True)
        chain = self.keys.chain(keys, prefix, self._format(name), interface, continues, for_read=True)
        ok = self._read(chain, bufs)
        if starts is not None:
            for good, buf, s in zip(ok, bufs, starts):
                if good:
                    pool.set_from_flat_data_page(s, buf)
        return ok

    def _set_pool_pages(self, name: str, pool, keys: Sequence[str], host_indices, prefix, interface: str,
                        continues: bool = True) -> List[bool]:
        if not keys:
            return []
        if pool is None:
            raise RuntimeError("no host pool registered")
        if not self.rank.writes(name):
            return self._skip_not_writer(len(keys))
        bufs, _ = self._page_buffers(name, pool, host_indices, len(keys), interface, for_read=False)
        chain = self.keys.chain(keys, prefix, self._format(name), interface, continues)
        events = self._events if name == KV_POOL else None
        parent_key = prefix[-1] if prefix and continues else None
        ok = self._write(name, chain, bufs, None if events is None else events.tags_for(keys, parent_key))
        if events is not None:
            events.stored(keys, parent_key, chain.keys, ok)
        return ok

    def _skip_not_writer(self, n: int) -> List[bool]:
        """Acknowledge a replicated page on an MLA non-writer rank: the storage writer stores it."""
        self._stats.add(pages_skipped_not_writer=n)
        return [True] * n

    def _prefix_keys(self, extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[List[str]]:
        """extra_info.prefix_keys for a read or write (not batch_exists: SGLang's hybrid controller
        sends None there for a sequence's first batch even when prefix keys are on)."""
        prefix = _prefix(extra_info)
        if prefix is None and self.config.redis_url:
            self._warn_no_prefix("SGLang sent no prefix_keys")
        return prefix

    def _warn_no_prefix(self, why: str) -> None:
        if self._warned_no_prefix:
            return
        self._warned_no_prefix = True
        log.warning("radixtier: %s, so each batch after a sequence's first is indexed under its own root "
                    "and other nodes' lookups miss it; for cross-node sharing set \"interface_v1\": 1 and "
                    "\"hicache_storage_pass_prefix_keys\": true in --hicache-storage-backend-extra-config", why)

    def _leading_run(self, chain: Chain) -> int:
        local, remote, lookup_s = self._ensure_open().leading_run(chain.root, chain.keys)
        self._stats.add(exists_calls=1)
        self._observe_lookup(lookup_s, remote)
        return local + remote

    def _sidecar_have(self, chain: Chain, from_end: bool) -> List[bool]:
        """Per page: held here or, through the index, by another rank/node (replicated sidecars are
        written by the MLA writer only); see TierClient.have."""
        have, found, lookup_s = self._ensure_open().have(chain.root, chain.keys, from_end)
        self._observe_lookup(lookup_s, found)
        return have

    def _observe_lookup(self, lookup_s: float, found: int) -> None:
        """An index lookup's time and the remote pages it named (nothing when none was asked)."""
        prom = self._prom
        if prom is not None and lookup_s:
            prom.observe("index_lookup_seconds", lookup_s)
            prom.inc("remote_pages_found", found)

    def _read(self, chain: Chain, bufs: List[Any]) -> List[bool]:
        client = self._ensure_open()
        t0 = time.perf_counter()
        res = client.read(chain.root, chain.keys, bufs)
        n_ok = res.local + res.remote
        self._stats.add(pages_local=res.local, pages_remote=res.remote, pages_missed=res.missed)
        elapsed = time.perf_counter() - t0
        if n_ok:
            self._stats.record(True, n_ok, n_ok * self._page_nbytes(bufs[0]), elapsed)
        prom = self._prom
        self._observe_lookup(res.lookup_s, res.found)
        if prom is not None:
            prom.observe("storage_read_seconds", elapsed)
            prom.inc("remote_pages_read", res.remote)
            prom.inc("remote_pages_missed", res.missed)
            prom.sync_store(client.stats())
        return res.ok

    def _write(self, pool: str, chain: Chain, bufs: List[Any],
               tags: Optional[List[Optional[RouterTag]]] = None) -> List[bool]:
        client = self._ensure_open()
        t0 = time.perf_counter()
        out = client.write(chain.root, chain.keys, bufs, chain.parents, tags)
        res = out.put
        n_ok = sum(res.ok)
        self._stats.add(pages_written=res.written, pages_already_stored=res.already_stored,
                        pages_write_failed=len(res.ok) - n_ok)
        elapsed = time.perf_counter() - t0
        if res.written:  # SGLang's backup figures: pages and bytes that reached the device, nothing else
            self._stats.record(False, res.written, res.written * self._page_nbytes(bufs[0]), elapsed)
        if res.already_stored:
            self._note_already_stored(res.already_stored)
        if self._events is not None:
            self._events.removed(out.removed)
        prom = self._prom
        if prom is not None:
            prom.observe("storage_write_seconds", elapsed)
            prom.inc("backup_already_stored_pages", res.already_stored)
            prom.sync_store(client.stats())
            health = client.health()
            if health is not None:
                prom.sync_index(health)
        return list(res.ok)

    def _note_already_stored(self, pages: int) -> None:
        """A backup of pages tier 3 already holds: SGLang computed KV it could have loaded. Said once,
        with its likely cause (diagnosis.py); counted always."""
        if self._warned_already_stored:
            return
        self._warned_already_stored = True
        extra = self.storage_config.extra_config or {}
        threshold = extra.get("prefetch_threshold")
        cause = already_stored_cause(self.registered_pools, prefetch_policy(),
                                     threshold if isinstance(threshold, int) else None)
        log.warning("radixtier: SGLang asked to back up %d page(s) tier 3 already holds: it recomputed KV it could "
                    "have loaded: %s; counted in radixtier:backup_already_stored_pages_total", pages, cause)

    @staticmethod
    def _page_nbytes(buf) -> int:
        if isinstance(buf, list):
            return sum(n for _p, n in buf)
        return buf.numel() * buf.element_size()

    def _guard(self, op: str, n: int, fn, failed: Any = False) -> List[Any]:
        """Run one SGLang call; any error is logged and turned into misses, never raised into SGLang."""
        try:
            return fn()
        except ArgumentError as exc:
            self._stats.add(errors=1)
            self._refusals.refused(op, n, exc)
            return [failed] * n
        except Exception as exc:
            self._stats.add(errors=1)
            log.error("radixtier: %s of %d page(s) failed: %s", op, n, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            return [failed] * n

    # ---------------------------------------------------------------- housekeeping
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the index has every record published so far (tests, orderly shutdown)."""
        client = self._client
        return True if client is None else client.flush(timeout)

    def clear(self) -> bool:
        try:
            client = self._ensure_open()
            keys = client.clear()
            if self._events is not None:
                self._events.cleared()
            log.info("radixtier: cleared %d pages from %s partition %d", len(keys), self.config.path,
                     client.store.partition)
            return True
        except Exception as exc:
            log.error("radixtier: clear failed: %s", exc)
            return False

    def get_stats(self):
        """SGLang's StorageMetrics for the interval since the last call (SGLang logs them as histograms)."""
        return self._stats.take_interval()

    def radixtier_stats(self) -> Dict[str, Any]:
        """Totals since start: pages by source, writes, errors, and the store's own counters."""
        with self._stats.lock:
            totals = dict(self._stats.totals)
        client = self._client
        if client is not None:
            totals["store"] = client.stats()
            health = client.health()
            if health is not None:
                totals["index"] = health
        events = None if self._events is None else self._events.stats()
        if events is not None:
            totals["kv_events"] = events
        return totals

    def close(self) -> None:
        with self._open_lock:
            if self._closed:
                return
            self._closed = True
            client, events = self._client, self._events
            self._client = self._events = None
        try:
            if events is not None:
                events.close()
        finally:
            if client is not None:
                client.close()


def _prefix(extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[List[str]]:
    return None if extra_info is None else extra_info.prefix_keys
