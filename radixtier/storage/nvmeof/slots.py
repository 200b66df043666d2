"""The slot room of a page store: which key is in which slot of one partition, and the on-device
slot table that makes that survive a restart.

Owns, for one partition: the key -> slot index, the free list, the next generation, the
in-memory copy of the partition's slot table and its flushes, the eviction order (pins
included: a page being read is never a victim, never dropped) and the list of evicted keys not
yet taken. It reads no page and writes no page data: page I/O does that (page_io.py), the store
says when (store.py).

Locks (order: `table_lock` before `lock`): `lock` guards every field above and is taken by the
store around each step of a call (methods whose name ends in `_locked` expect it held; the
others take it); `table_lock` serialises table flushes, which write and fdatasync under it but
never under `lock`, so the serving path never waits on the device for it.

A held page's place is a plain tuple of atoms, (slot, generation, length, checksum, parent key or
None), not an object: CPython's collector stops tracking such tuples, so a store holding millions
of pages adds nothing to the full collections that pause every thread of an SGLang process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from radixtier.storage.eviction import PLAIN_LRU, EvictionOrder
from radixtier.storage.nvmeof.io_engine import IOOp, aligned_buffer
from radixtier.storage.nvmeof.layout import BLOCK, ENTRY_BYTES, FREE_ENTRY, TableEntry
from radixtier.storage.nvmeof.status import StoreCounters

log = logging.getLogger("radixtier.storage.nvmeof")

Slot = Tuple[int, int, int, int, Optional[bytes]]
SLOT, GEN, LENGTH, CSUM, PARENT = range(5)
_MAX_PENDING_TOUCHES = 4096  # read keys waiting to reach the eviction order (applying them holds the lock ~5 ms)
# check(used slots, full) -> slots whose header (or payload) does not match their entry
SlotCheck = Callable[[List[Tuple[int, TableEntry]], bool], Set[int]]


class SlotTable:
    """One partition's slots (see module docstring)."""

    def __init__(self, slots: range, page_bytes: int, table: bytearray, table_base: int, eviction: str,
                 engine, fd: int, deadline: Callable[[], Optional[float]], sync: bool, counters: StoreCounters,
                 path: str) -> None:
        self.lock = threading.Lock()
        self.table_lock = threading.Lock()
        self._range = slots
        self._page_bytes = page_bytes
        self._table = table  # the partition's table, as on the device once flushed
        self._table_base = table_base
        self._engine = engine
        self._fd = fd
        self._deadline = deadline  # the lease's write deadline (OSError when no write may be issued)
        self._sync = sync
        self._counters = counters
        self._path = path
        self.index: Dict[bytes, Slot] = {}
        self.order = EvictionOrder(eviction)
        self._free: List[int] = []
        self._next_gen = 1
        self._touched: List[bytes] = []  # pages read since the eviction order last caught up
        self._evicted: List[bytes] = []
        self.entries_found = 0  # table entries recover() found (before any was dropped)

    # ------------------------------------------------------------------ recovery
    def recover(self, check: Optional[SlotCheck], full: bool) -> int:
        """Build the index from the table read at open; `check` (None: trust the table) re-reads
        slot headers, and entries that fail it are freed on the device. Returns entries dropped."""
        first, page_bytes = self._range.start, self._page_bytes
        used = []
        for i in range(len(self._range)):
            e = TableEntry.unpack(bytes(self._table[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES]))
            if e is not None and e.length <= page_bytes:
                used.append((first + i, e))
        self.entries_found = len(used)
        dropped = 0
        if check is not None:
            bad = check(used, full)
            dropped = len(bad)
            if bad:
                for slot in bad:
                    self.set_entry_locked(slot, FREE_ENTRY)
                self.flush(sorted({self.entry_block(s) for s in bad}))
                used = [(s, e) for s, e in used if s not in bad]
        gen = 0
        index = self.index
        for slot, e in sorted(used, key=lambda se: se[1].generation):
            if e.key in index:  # two slots claim one key: keep the newer
                old = index.pop(e.key)
                self.set_entry_locked(old[SLOT], FREE_ENTRY)
            index[e.key] = (slot, e.generation, e.length, e.checksum, e.parent)
            gen = max(gen, e.generation)
        for key in index:
            self.order.add(key, None)
        for key, s in index.items():
            if s[PARENT] is not None:
                self.order.set_parent(key, s[PARENT])
        taken = {s[SLOT] for s in index.values()}
        self._free = [s for s in reversed(self._range) if s not in taken]
        self._next_gen = gen + 1
        return dropped

    # ------------------------------------------------------------------ the table
    def entry_block(self, slot: int) -> int:
        return (slot - self._range.start) * ENTRY_BYTES // BLOCK

    def set_entry_locked(self, slot: int, packed) -> None:
        """A slot's entry in the in-memory table: a packed TableEntry, or FREE_ENTRY."""
        i = (slot - self._range.start) * ENTRY_BYTES
        self._table[i:i + ENTRY_BYTES] = packed

    def flush(self, blocks: Iterable[int]) -> None:
        """Write table blocks (whole 4 KiB blocks from the in-memory copy), then make them durable.
        OSError when the lease allows no write now, or the write failed."""
        blocks = sorted(set(blocks))
        if not blocks:
            return
        with self.table_lock:
            deadline = self._deadline()
            ops, runs = [], []
            for b in blocks:
                if runs and runs[-1][1] == b:
                    runs[-1][1] = b + 1
                else:
                    runs.append([b, b + 1])
            for lo, hi in runs:
                buf = aligned_buffer((hi - lo) * BLOCK)
                with self.lock:
                    buf[:] = self._table[lo * BLOCK:hi * BLOCK]
                ops.append(IOOp(True, self._fd, self._table_base + lo * BLOCK, [buf]))
            res = self._engine.run(ops, None, deadline)
            if any(r < op.nbytes for r, op in zip(res, ops)):
                self._counters.io_errors += 1
                raise OSError(f"{self._path}: slot table write failed")
            if self._sync:
                os.fdatasync(self._fd)

    def flush_logged(self, blocks: Iterable[int]) -> None:
        """flush() for removals: on failure the entries stay on the device, where the next open
        re-checks them against their slot headers (a removed page is never served wrongly)."""
        try:
            self.flush(blocks)
        except OSError as exc:
            log.error("radixtier: %s: slot table update failed: %s", self._path, exc)

    # ------------------------------------------------------------------ placing pages (under lock)
    def generations_locked(self, n: int) -> List[int]:
        g = self._next_gen
        self._next_gen += n
        return list(range(g, g + n))

    def take_slot_locked(self, evicted: List[bytes]) -> Optional[int]:
        """A free slot, or the slot of the next leaves-first LRU victim; None when every candidate
        is being read. The victim's key is appended to `evicted`."""
        if self._free:
            return self._free.pop()
        self._apply_touches()
        victim = self.order.next_victim()
        if victim is None:
            return None
        c = self._counters
        if self.order.is_held(victim):
            c.evicted_held += 1
        elif self.order.mode == PLAIN_LRU:
            c.evicted_lru += 1
        else:
            c.evicted_leaves_first += 1
        c.evictions += 1
        s = self._drop(victim)
        evicted.append(victim)
        self._evicted.append(victim)
        return s[SLOT]

    def release_locked(self, slots: Iterable[int]) -> None:
        """Slots that hold nothing (any more) go back on the free list."""
        self._free.extend(slots)

    def commit_locked(self, key: bytes, placed: Slot) -> None:
        """A written, table-flushed page becomes visible to readers (in the order and the index, or
        in neither: a failure here leaves the slot to put()'s clean-up, never half-indexed)."""
        self.order.add(key, placed[PARENT])
        try:
            self.index[key] = placed
        except BaseException:
            self.order.remove(key)
            raise

    def remove_locked(self, key: bytes, blocks: List[int]) -> bool:
        """delete() of one key: not while it is being read. Its table block goes in `blocks`."""
        if key not in self.index or self.order.is_pinned(key):
            return False
        s = self._drop(key)
        self.set_entry_locked(s[SLOT], FREE_ENTRY)
        self._free.append(s[SLOT])
        blocks.append(self.entry_block(s[SLOT]))
        return True

    def free_unproven_locked(self, key: bytes, s: Slot, blocks: List[int]) -> None:
        """A page that failed proof leaves the index and its slot is freed, so it is never read
        again -- unless the key moved on meanwhile (rewritten) or another reader holds it."""
        cur = self.index.get(key)
        if cur is not None and cur[SLOT] == s[SLOT] and cur[GEN] == s[GEN] and not self.order.is_pinned(key):
            self._drop(key)
            self.set_entry_locked(s[SLOT], FREE_ENTRY)
            self._free.append(s[SLOT])
            self._evicted.append(key)
            blocks.append(self.entry_block(s[SLOT]))

    def _drop(self, key: bytes) -> Slot:
        s = self.index.pop(key)
        self.order.remove(key)
        return s

    # ------------------------------------------------------------------ reads (under lock)
    def begin_read_locked(self, keys: Sequence[bytes]) -> int:
        """Reads count as recent use (applied to the order lazily: it is only consulted when a
        victim is chosen, so the read path only appends keys) and pin the batch until end_read."""
        self._touched.extend(keys)
        if len(self._touched) > _MAX_PENDING_TOUCHES:
            self._apply_touches()
        return self.order.pin_batch(keys)

    def end_read(self, token: int) -> None:
        with self.lock:
            self.order.unpin_batch(token)

    def _apply_touches(self) -> None:
        if self._touched:
            self.order.touch_many(self._touched)
            self._touched.clear()

    # ------------------------------------------------------------------ queries (take the lock)
    def hold(self, keys: Sequence[bytes], held: bool) -> None:
        with self.lock:
            for k in keys:
                k = bytes(k)
                if k in self.index:
                    self.order.hold(k, held)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for k in keys:
                self.order.touch(k)

    def take_evicted(self) -> List[bytes]:
        with self.lock:
            out, self._evicted = self._evicted, []
            return out

    @property
    def num_free(self) -> int:
        with self.lock:
            return len(self._free)
