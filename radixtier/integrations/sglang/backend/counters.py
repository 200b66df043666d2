"""The backend's own counters: what SGLang's StorageMetrics wants per interval (pages and
bandwidth of prefetches and backups), and totals since start for radixtier_stats()."""

from __future__ import annotations

import threading
from typing import List


class BackendCounters:
    """Per-interval page counts and bandwidths, in the shape SGLang's StorageMetrics wants."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pgs: List[int] = []
        self.backup_pgs: List[int] = []
        self.prefetch_bandwidth: List[float] = []
        self.backup_bandwidth: List[float] = []
        # pages_written: pages this call wrote; pages_already_stored: pages SGLang asked to back up that
        # tier 3 held already (SGLang recomputed what it could have loaded; see _note_already_stored)
        self.totals = {"exists_calls": 0, "pages_local": 0, "pages_remote": 0, "pages_missed": 0,
                       "pages_written": 0, "pages_already_stored": 0, "pages_write_failed": 0,
                       "pages_skipped_not_writer": 0, "errors": 0}

    def record(self, read: bool, pages: int, nbytes: int, seconds: float) -> None:
        gbps = nbytes / max(seconds, 1e-9) / 1e9
        with self.lock:
            (self.prefetch_pgs if read else self.backup_pgs).append(pages)
            (self.prefetch_bandwidth if read else self.backup_bandwidth).append(gbps)

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, v in counts.items():
                self.totals[k] += v

    def take_interval(self):
        """SGLang's StorageMetrics for the interval since the last call, and a fresh interval."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self.lock:
            m = StorageMetrics(prefetch_pgs=self.prefetch_pgs, backup_pgs=self.backup_pgs,
                               prefetch_bandwidth=self.prefetch_bandwidth, backup_bandwidth=self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth = [], [], [], []
        return m
