"""What a page read or write came to, and the store's counters: one vocabulary for both I/O paths.

`PageStatus` is the per-page outcome the native core writes into its status bytes
(`_pagebatch.c`, `enum { ST_OK, ... }`) and the Python path produces the same way, so the store
reads both with one piece of code. The C module exports its values (`_uring.STATUS`); the io_uring
engine refuses to load a build whose values differ from these (see io_engine.native_mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Dict


class PageStatus(IntEnum):
    OK = 0        # read and proven (header and checksum), or written
    IO = 1        # the I/O failed or came back short
    HEADER = 2    # slot header does not match: torn or foreign
    CHECKSUM = 3  # payload checksum mismatch: torn or corrupt
    NOT_RUN = 4   # never issued: the I/O ring failed (a plain miss; the page stays)
    STALE = 5     # a sound header of another page or generation: the slot was reused

    @property
    def why(self) -> str:
        """How a failure is said in a log line."""
        return _WHY[self]


_WHY = {PageStatus.OK: "proven", PageStatus.IO: "I/O error",
        PageStatus.HEADER: "slot header does not match: torn or foreign",
        PageStatus.CHECKSUM: "payload checksum mismatch: torn or corrupt",
        PageStatus.NOT_RUN: "not read: the I/O ring failed",
        PageStatus.STALE: "stale: the slot holds another page or generation"}

# status bytes as the native core and PythonPageIO return them: a whole batch is compared in one step
ALL_OK = PageStatus.OK.value
IO_FAILED = frozenset({PageStatus.IO.value, PageStatus.NOT_RUN.value})  # the device failed, not the page
NOT_RUN = PageStatus.NOT_RUN.value
# statuses of an unproven page -> the counter that counts it (besides `corrupt`)
FAILURE_COUNTER = {PageStatus.HEADER.value: "corrupt_header", PageStatus.CHECKSUM.value: "corrupt_checksum",
                   PageStatus.STALE.value: "corrupt_stale"}


def why(status: int) -> str:
    """The log text of a status byte (an unknown value is said as such, never raised on)."""
    try:
        return PageStatus(status).why
    except ValueError:
        return f"unknown status {status}: torn, stale or corrupt"


@dataclass
class StoreCounters:
    """What the store has done since it opened (its stats() and radixtier's metrics read these).
    Plain ints bumped by the store and its page I/O; a torn read of one is harmless."""

    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    misses: int = 0
    corrupt: int = 0  # pages that failed verification, all kinds; by kind:
    corrupt_header: int = 0  # torn or foreign slot header
    corrupt_checksum: int = 0  # payload CRC-32C mismatch (torn or corrupt data)
    corrupt_stale: int = 0  # a sound header of another page or generation (the slot was reused)
    evictions: int = 0  # all victims; by reason:
    evicted_held: int = 0  # held by a faster tier: the first to go
    evicted_leaves_first: int = 0  # leaves-first LRU
    evicted_lru: int = 0  # plain per-page LRU mode
    io_errors: int = 0
    bounced: int = 0
    fenced_writes: int = 0
    tags_named: int = 0  # pages router_tags() named (proven and still held)
    tags_failed: int = 0  # tagged entries whose header or tag failed the proof when read back

    def as_dict(self) -> Dict[str, int]:
        return dict(self.__dict__)

    def count_unproven(self, status: int) -> None:
        """A page not proven: counted in all, and by kind."""
        self.corrupt += 1
        kind = FAILURE_COUNTER.get(status)
        if kind == "corrupt_header":
            self.corrupt_header += 1
        elif kind == "corrupt_checksum":
            self.corrupt_checksum += 1
        elif kind == "corrupt_stale":
            self.corrupt_stale += 1
