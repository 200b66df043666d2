"""Pages being read right now, so eviction and deletion leave them alone until the read ends.

Why a set per read and not a count per page: a read registers and releases a whole batch (often
thousands of pages), and a set built from the batch's keys is one C-level pass, where counting
per page was two Python loops on the read path. Membership asks each running read; there are
only as many as concurrent get() calls (a handful), and it is asked only by eviction, delete and
the drop of an unproven page, never per page read.

Not thread-safe by itself: the store calls it under its own lock.
"""

from __future__ import annotations

from typing import Dict, Iterable, Set


class PagesInRead:
    """The keys of every read in flight, one set per read (see module docstring)."""

    def __init__(self) -> None:
        self._reads: Dict[int, Set[bytes]] = {}
        self._next = 0

    def begin(self, keys: Iterable[bytes]) -> int:
        """Register one read's keys; returns the token its end() takes."""
        token = self._next
        self._next += 1
        self._reads[token] = set(keys)
        return token

    def end(self, token: int) -> None:
        del self._reads[token]

    def __contains__(self, key: object) -> bool:
        for keys in self._reads.values():
            if key in keys:
                return True
        return False

    def __len__(self) -> int:
        """Keys registered, counting a key once per read that holds it (a bound, not a census)."""
        return sum(map(len, self._reads.values()))
