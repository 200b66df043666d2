"""Prometheus metrics for radixtier, in the ecosystem's style: `radixtier:` prefix (like `sglang:` and
`vllm:`), counters ending `_total`, histograms in seconds, labels node / partition / rank.

Why a module of its own: the metric families must exist once per process (prometheus_client
refuses a second registration of a name), while a process may hold several stores or backends;
and in SGLang they must be created only after SGLang has set PROMETHEUS_MULTIPROC_DIR, so that
prometheus_client writes them to the shared directory SGLang's `/metrics` collects from (its
multiprocess mode). prometheus_client is therefore imported on first use, never at import time,
and gauges use the `livesum` mode (per-label sums over live processes).

Counters follow the owners' own monotonic counters by delta (`sync`), so the hot paths keep their
plain integer counters and pay for Prometheus once per call, not per page.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

LABELS = ("node", "partition", "rank")
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# store counter -> (metric, extra labels)
_STORE_COUNTERS = {
    "reads": ("storage_read_pages", {}), "read_bytes": ("storage_read_bytes", {}),
    "writes": ("storage_written_pages", {}), "write_bytes": ("storage_written_bytes", {}),
    "misses": ("storage_missed_pages", {}), "io_errors": ("storage_io_errors", {}),
    "corrupt_header": ("storage_verification_failures", {"kind": "header"}),
    "corrupt_checksum": ("storage_verification_failures", {"kind": "checksum"}),
    "corrupt_stale": ("storage_verification_failures", {"kind": "stale_generation"}),
    "evicted_leaves_first": ("storage_evictions", {"reason": "leaves_first"}),
    "evicted_held": ("storage_evictions", {"reason": "held"}),
    "evicted_lru": ("storage_evictions", {"reason": "lru"}),
}
# index health counter -> metric
_INDEX_COUNTERS = {"lookups": "index_lookups", "lookup_failures": "index_lookup_failures",
                   "dropped_ops": "index_dropped_ops", "rejected_records": "index_rejected_records",
                   "published": "index_published_pages"}


class _Families:
    """Every radixtier metric family, created once per process (see module docstring)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, doc: str, extra=()):
            return Counter(f"radixtier:{name}", doc, LABELS + tuple(extra))

        def gauge(name: str, doc: str, extra=()):
            return Gauge(f"radixtier:{name}", doc, LABELS + tuple(extra), multiprocess_mode="livesum")

        def hist(name: str, doc: str):
            return Histogram(f"radixtier:{name}", doc, LABELS, buckets=LATENCY_BUCKETS)

        self.counters = {
            "storage_read_pages": counter("storage_read_pages", "Tier-3 pages read and proven (header + CRC)"),
            "storage_read_bytes": counter("storage_read_bytes", "Tier-3 bytes read and proven"),
            "storage_written_pages": counter("storage_written_pages", "Tier-3 pages written durably and indexed"),
            "storage_written_bytes": counter("storage_written_bytes", "Tier-3 bytes written"),
            "storage_missed_pages": counter("storage_missed_pages", "Tier-3 pages asked for and not held"),
            "storage_io_errors": counter("storage_io_errors", "Tier-3 I/O calls that failed"),
            "storage_verification_failures": counter(
                "storage_verification_failures", "Tier-3 pages that failed proof, never served, by kind", ("kind",)),
            "storage_evictions": counter("storage_evictions", "Tier-3 pages evicted, by reason", ("reason",)),
            "index_lookups": counter("index_lookups", "Prefix-index chain lookups"),
            "index_lookup_failures": counter("index_lookup_failures", "Lookups answered 'nothing remote' on a fault"),
            "index_dropped_ops": counter("index_dropped_ops", "Index updates dropped (queue full or retries spent)"),
            "index_rejected_records": counter("index_rejected_records", "Index entries ignored as malformed"),
            "index_published_pages": counter("index_published_pages", "Pages published to the index"),
            "remote_pages_found": counter("remote_pages_found", "Pages the index says other nodes hold (exists)"),
            "remote_pages_read": counter("remote_pages_read", "Pages read from other nodes' slots, proven"),
            "remote_pages_missed": counter("remote_pages_missed", "Pages asked for that no tier could serve"),
            "backup_already_stored_pages": counter(
                "backup_already_stored_pages", "Pages SGLang backed up that tier 3 already held (KV it recomputed "
                "instead of loading: a dropped prefetch, or a hit under prefetch_threshold)"),
            "cache_hit_tokens": counter("cache_hit_tokens", "Prefix tokens served, by tier (embedded engine)",
                                        ("tier",)),
            "cache_lookup_tokens": counter("cache_lookup_tokens", "Prompt tokens looked up (embedded engine)"),
            "cache_moved_bytes": counter("cache_moved_bytes", "Bytes moved between tiers, by direction",
                                         ("direction",)),
        }
        self.gauges = {
            "storage_capacity_pages": gauge("storage_capacity_pages", "Tier-3 slots in this partition"),
            "storage_used_pages": gauge("storage_used_pages", "Tier-3 slots holding a page"),
            "storage_capacity_bytes": gauge("storage_capacity_bytes", "Tier-3 page bytes this partition holds"),
            "storage_used_bytes": gauge("storage_used_bytes", "Tier-3 page bytes in use (slots x page bytes)"),
            "index_up": gauge("index_up", "1 while the prefix index answers lookups, else 0"),
            "index_publish_queue_depth": gauge("index_publish_queue_depth", "Index updates waiting to be written"),
        }
        self.histograms = {
            "storage_read_seconds": hist("storage_read_seconds", "Time of one tier-3 batch read (a prefetch call)"),
            "storage_write_seconds": hist("storage_write_seconds", "Time of one tier-3 batch write (a backup call)"),
            "index_lookup_seconds": hist("index_lookup_seconds", "Time of one prefix-index chain lookup"),
        }


_families: Optional[_Families] = None
_families_lock = threading.Lock()


def families() -> _Families:
    global _families
    with _families_lock:
        if _families is None:
            _families = _Families()
        return _families


class MetricsReporter:
    """The metrics of one store / backend / cache, labelled with its node, partition and rank.
    Thread-safe: calls come from SGLang's transfer threads; `sync` is serialised by a leaf lock."""

    def __init__(self, node: str, partition: int = 0, rank: int = 0) -> None:
        self.fam = families()
        self.labels = {"node": node, "partition": str(partition), "rank": str(rank)}
        self._last: Dict[tuple, int] = {}
        self._lock = threading.Lock()

    def _inc_to(self, metric: str, extra: Dict[str, str], total: int) -> None:
        """Advance a counter to the owner's monotonic total (by the delta since the last sync)."""
        key = (metric, tuple(sorted(extra.items())))
        delta = total - self._last.get(key, 0)
        if delta > 0:
            self.fam.counters[metric].labels(**self.labels, **extra).inc(delta)
        self._last[key] = max(total, self._last.get(key, 0))

    def inc(self, metric: str, n: int = 1, **extra: str) -> None:
        if n > 0:
            self.fam.counters[metric].labels(**self.labels, **extra).inc(n)

    def observe(self, histogram: str, seconds: float) -> None:
        self.fam.histograms[histogram].labels(**self.labels).observe(seconds)

    def sync_store(self, stats: Dict[str, object]) -> None:
        """From NvmeofPageStore.stats(): capacity and use, pages and bytes moved, failures, evictions."""
        with self._lock:
            g = self.fam.gauges
            page = int(stats.get("page_bytes", 0))
            g["storage_capacity_pages"].labels(**self.labels).set(stats.get("capacity_pages", 0))
            g["storage_used_pages"].labels(**self.labels).set(stats.get("used_pages", 0))
            g["storage_capacity_bytes"].labels(**self.labels).set(int(stats.get("capacity_pages", 0)) * page)
            g["storage_used_bytes"].labels(**self.labels).set(int(stats.get("used_pages", 0)) * page)
            for field, (metric, extra) in _STORE_COUNTERS.items():
                self._inc_to(metric, extra, int(stats.get(field, 0)))

    def sync_index(self, health: Optional[Dict[str, object]]) -> None:
        """From a prefix index's health(): up, queue depth, lookups, failures, dropped updates."""
        if health is None:
            return
        with self._lock:
            g = self.fam.gauges
            g["index_up"].labels(**self.labels).set(1 if health.get("up") else 0)
            g["index_publish_queue_depth"].labels(**self.labels).set(int(health.get("queue_depth", 0)))
            for field, metric in _INDEX_COUNTERS.items():
                self._inc_to(metric, {}, int(health.get(field, 0)))

    def sync_cache(self, snapshot: Dict[str, object]) -> None:
        """From the embedded engine's CacheStats.snapshot(): hits by tier, bytes moved by direction."""
        with self._lock:
            for tier, tokens in dict(snapshot.get("hit_tokens", {})).items():
                self._inc_to("cache_hit_tokens", {"tier": tier}, int(tokens))
            self._inc_to("cache_lookup_tokens", {}, int(snapshot.get("lookup_tokens", 0)))
            for direction, nbytes in dict(snapshot.get("bytes_moved", {})).items():
                self._inc_to("cache_moved_bytes", {"direction": direction}, int(nbytes))


class PeriodicSync:
    """Calls `sync` every interval_s on a daemon thread until stop() (the embedded engine's metrics
    are refreshed off the serving path)."""

    def __init__(self, sync: Callable[[], None], interval_s: float) -> None:
        self._stop = threading.Event()
        self._sync, self._interval = sync, interval_s
        self._thread = threading.Thread(target=self._run, name="radixtier-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._sync()
            except Exception:  # pragma: no cover - metrics must never take the engine down
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sync()  # the last figures


def serve(port: int, addr: str = "127.0.0.1") -> Callable[[], None]:
    """Expose this process's metrics on http://addr:port/metrics (the embedded engine, when asked);
    returns a function that stops the server."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=addr)

    def stop() -> None:
        server.shutdown()
        thread.join(timeout=5)

    return stop
