"""What the prefix index's health() reports besides link states: its counters and its problem log.

Owns the counters (lookups, publishes, repairs, ...) and the problems met in registry data, in our
identity and in background work. Every part of the index writes here and health() reads here;
why a room of its own: the parts share these two objects instead of calling back into the index.
Both locks are leaves: held for a dict update only, never while taking another lock or doing I/O
(callers may hold their own lock when they count, never the reverse).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Tuple

log = logging.getLogger("radixtier.storage.redis")

LOG_EVERY_S = 60.0  # one log line per distinct problem per this many seconds
PROBLEM_KEEP_S = 300.0  # health() lists problems seen this recently

COUNTER_NAMES = ("lookups", "lookup_failures", "chain_failures", "rejected_records", "dead_records_ignored",
                 "published", "unpublished", "dropped_ops", "republished", "reconnects", "gc_removed",
                 "stale_removed", "publish_failures", "registry_repairs")


class Counters:
    """The index's counters: `values` is the live dict (RedisPrefixIndex.counters), add() the one writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: Dict[str, int] = {name: 0 for name in COUNTER_NAMES}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self.values)


class Problems:
    """Problems met in registry data (kind "registry"), in our identity ("identity") and in the
    background work ("errors"), each logged at most once per LOG_EVERY_S (a bad key met on every
    heartbeat used to log ~40 lines a second) and listed by health() while seen within the last
    PROBLEM_KEEP_S."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: Dict[str, Tuple[str, str, float, float]] = {}  # what -> (kind, message, last seen, last logged)

    def note(self, what: str, message: str, level: int = logging.WARNING, kind: str = "registry") -> None:
        now = time.monotonic()
        with self._lock:
            logged = self._seen.get(what, ("", "", 0.0, -LOG_EVERY_S))[3]
            due = now - logged >= LOG_EVERY_S
            self._seen[what] = (kind, message, now, now if due else logged)
            if len(self._seen) > 256:  # bounded: forget the oldest
                del self._seen[min(self._seen, key=lambda w: self._seen[w][2])]
        if due:
            log.log(level, "radixtier: %s", message)

    def recent(self, kind: str) -> List[str]:
        """Messages of `kind` seen within PROBLEM_KEEP_S, oldest first."""
        now = time.monotonic()
        with self._lock:
            items = sorted((at, m) for k, m, at, _l in self._seen.values() if k == kind and now - at < PROBLEM_KEEP_S)
        return [m for _at, m in items]
