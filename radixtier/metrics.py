"""Counters an operator reads: hits per tier, bytes moved per direction, transfer failures."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict

from radixtier.tiers import Tier

DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host", "remote_to_host")


class CacheStats:
    """Thread-safe monotonically increasing counters; `snapshot()` gives a plain dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hit_tokens: Dict[str, int] = {t.label: 0 for t in Tier}
        self.lookup_tokens = 0
        self.miss_tokens = 0
        self.bytes_moved: Dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.pages_moved: Dict[str, int] = {d: 0 for d in DIRECTIONS}
        self.failures: Dict[str, int] = defaultdict(int)
        self.evictions: Dict[str, int] = {t.label: 0 for t in Tier}
        self.inline_spill_pages = 0  # host victims staged and written down at eviction time
        self.requests = 0

    def record_lookup(self, total_tokens: int, hits_by_tier: Dict[Tier, int]) -> None:
        with self._lock:
            self.requests += 1
            self.lookup_tokens += total_tokens
            hit = 0
            for tier, tokens in hits_by_tier.items():
                self.hit_tokens[tier.label] += tokens
                hit += tokens
            self.miss_tokens += max(0, total_tokens - hit)

    def record_move(self, direction: str, pages: int, nbytes: int) -> None:
        with self._lock:
            self.pages_moved[direction] += pages
            self.bytes_moved[direction] += nbytes

    def record_failure(self, direction: str, pages: int = 1) -> None:
        with self._lock:
            self.failures[direction] += pages

    def record_eviction(self, tier: Tier, pages: int) -> None:
        with self._lock:
            self.evictions[tier.label] += pages

    def record_inline_spill(self, pages: int) -> None:
        with self._lock:
            self.inline_spill_pages += pages

    def snapshot(self) -> Dict[str, object]:
        with self._lock:
            hit = sum(self.hit_tokens.values())
            return {
                "requests": self.requests,
                "lookup_tokens": self.lookup_tokens,
                "hit_tokens": dict(self.hit_tokens),
                "miss_tokens": self.miss_tokens,
                "hit_rate": (hit / self.lookup_tokens) if self.lookup_tokens else 0.0,
                "bytes_moved": dict(self.bytes_moved),
                "pages_moved": dict(self.pages_moved),
                "failures": dict(self.failures),
                "evictions": dict(self.evictions),
                "inline_spill_pages": self.inline_spill_pages,
            }
