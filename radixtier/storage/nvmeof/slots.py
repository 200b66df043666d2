"""The slot room of a page store: which key is in which slot of one partition, and the on-device
slot table that makes that survive a restart.

Owns, for one partition: the key -> slot index, the free list, the next generation, the
in-memory copy of the partition's slot table and its flushes, the eviction order (pins
included: a page being read is never a victim, never dropped) and the keys it dropped outside a
put (pages a read could not prove). It reads no page and writes no page data: page I/O does that
(page_io.py); the store says when (store.py).

Its interface is whole batches, each step one hold of its lock:
- a put: `plan_put` (already stored, duplicates, slots and victims, generations) -> the page
  writes -> `commit_put` (table entries, made durable, then the index) or `refuse_put` /
  `abandon_put` (the slots go back);
- a read: `start_read` (find, check sizes, pin) -> the page reads -> `finish_read` (unpin,
  count, free what failed proof);
- queries: `exists`, `leading_run`, `location(s)`, `entries`, and `delete`, `hold`, `touch`.

Locks (order: `_table_lock` before `_lock`): `_lock` guards every field above; `_table_lock`
serialises table flushes, which write and fdatasync under it but never under `_lock`, so the
serving path never waits on the device for it. Neither lock nor the index's tuples leave this
module.

A held page's place is a plain tuple of atoms, (slot, generation, length, checksum, parent key or
None) -- page I/O's `SlotTuple`, whose first four fields it reads -- not an object: CPython's
collector stops tracking such tuples, so a store holding millions of pages adds nothing to the
full collections that pause every thread of an SGLang process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from radixtier.eviction import PLAIN_LRU, EvictionOrder
from radixtier.storage.nvmeof.io_engine import IOOp, aligned_buffer
from radixtier.storage.nvmeof.layout import BLOCK, ENTRY_BYTES, FREE_ENTRY, TableEntry
from radixtier.storage.nvmeof.page_io import WriteItem
from radixtier.storage.nvmeof.status import ALL_OK, IO_FAILED, NOT_RUN, StoreCounters, why

log = logging.getLogger("radixtier.storage.nvmeof")

Slot = Tuple[int, int, int, int, Optional[bytes]]  # (slot, generation, length, checksum, parent)
_SLOT, _GEN, _LENGTH, _CSUM, _PARENT = range(5)
_MAX_PENDING_TOUCHES = 4096  # read keys waiting to reach the eviction order (applying them holds the lock ~5 ms)
# check(used slots, full) -> slots whose header (or payload) does not match their entry
SlotCheck = Callable[[List[Tuple[int, TableEntry]], bool], Set[int]]


class PutPlan:
    """What a put will do, decided in one hold of the slot lock (`SlotTable.plan_put`).

    ok[i]: key i is stored (already, or once committed); places[i]: its (slot, generation, length,
    checksum) once known; writes: the pages to write, as page I/O takes them (index, key, parent,
    slot, generation); evicted: the victims whose slots this batch took, in eviction order;
    dups: (index, index of the copy that is written) for a key twice in the batch."""

    __slots__ = ("ok", "places", "writes", "evicted", "already", "dups", "settled")

    def __init__(self, n: int) -> None:
        self.ok: List[bool] = [False] * n
        self.places: List[Optional[Tuple[int, int, int, int]]] = [None] * n
        self.writes: List[WriteItem] = []
        self.evicted: List[bytes] = []
        self.already = 0
        self.dups: List[Tuple[int, int]] = []
        self.settled = bytearray(0)  # 1 once write j's slot was committed or given back

    def written(self) -> int:
        return sum(self.ok[w[0]] for w in self.writes)


class ReadPlan:
    """The pages of a read that this partition holds (`SlotTable.start_read`): `keys` and `slots`
    (page I/O's SlotTuples) in read order, `at[j]` the caller's index of page j (None: the read
    holds every page asked for, in order), `n` pages asked for, `token` the batch's pin."""

    __slots__ = ("keys", "slots", "at", "n", "token")

    def __init__(self, keys: List[bytes], slots: List[Slot], at: Optional[List[int]], n: int, token: int) -> None:
        self.keys, self.slots, self.at, self.n, self.token = keys, slots, at, n, token


class SlotTable:
    """One partition's slots (see module docstring)."""

    def __init__(self, slots: range, page_bytes: int, table: bytearray, table_base: int, eviction: str,
                 engine, fd: int, deadline: Callable[[], Optional[float]], sync: bool, counters: StoreCounters,
                 path: str) -> None:
        self._lock = threading.Lock()
        self._table_lock = threading.Lock()
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
        self._index: Dict[bytes, Slot] = {}
        self._order = EvictionOrder(eviction)
        self._free: List[int] = []
        self._next_gen = 1
        self._touched: List[bytes] = []  # pages read since the eviction order last caught up
        self._dropped: List[bytes] = []  # pages freed outside a put (failed proof), not yet taken
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
                with self._lock:
                    for slot in bad:
                        self._set_entry(slot, FREE_ENTRY)
                self.flush(sorted({self._entry_block(s) for s in bad}))
                used = [(s, e) for s, e in used if s not in bad]
        gen = 0
        with self._lock:
            index = self._index
            for slot, e in sorted(used, key=lambda se: se[1].generation):
                if e.key in index:  # two slots claim one key: keep the newer
                    old = index.pop(e.key)
                    self._set_entry(old[_SLOT], FREE_ENTRY)
                index[e.key] = (slot, e.generation, e.length, e.checksum, e.parent)
                gen = max(gen, e.generation)
            for key in index:
                self._order.add(key, None)
            for key, s in index.items():
                if s[_PARENT] is not None:
                    self._order.set_parent(key, s[_PARENT])
            taken = {s[_SLOT] for s in index.values()}
            self._free = [s for s in reversed(self._range) if s not in taken]
            self._next_gen = gen + 1
        return dropped

    # ------------------------------------------------------------------ the table
    def _entry_block(self, slot: int) -> int:
        return (slot - self._range.start) * ENTRY_BYTES // BLOCK

    def _set_entry(self, slot: int, packed) -> None:
        """A slot's entry in the in-memory table (lock held): a packed TableEntry, or FREE_ENTRY."""
        i = (slot - self._range.start) * ENTRY_BYTES
        self._table[i:i + ENTRY_BYTES] = packed

    def flush(self, blocks: Iterable[int]) -> None:
        """Write table blocks (whole 4 KiB blocks from the in-memory copy), then make them durable.
        OSError when the lease allows no write now, or the write failed."""
        blocks = sorted(set(blocks))
        if not blocks:
            return
        with self._table_lock:
            deadline = self._deadline()
            ops, runs = [], []
            for b in blocks:
                if runs and runs[-1][1] == b:
                    runs[-1][1] = b + 1
                else:
                    runs.append([b, b + 1])
            for lo, hi in runs:
                buf = aligned_buffer((hi - lo) * BLOCK)
                with self._lock:
                    buf[:] = self._table[lo * BLOCK:hi * BLOCK]
                ops.append(IOOp(True, self._fd, self._table_base + lo * BLOCK, [buf]))
            res = self._engine.run(ops, None, deadline)
            if any(r < op.nbytes for r, op in zip(res, ops)):
                self._counters.io_errors += 1
                raise OSError(f"{self._path}: slot table write failed")
            if self._sync:
                os.fdatasync(self._fd)

    def _flush_logged(self, blocks: Iterable[int]) -> None:
        """flush() for removals: on failure the entries stay on the device, where the next open
        re-checks them against their slot headers (a removed page is never served wrongly)."""
        try:
            self.flush(blocks)
        except OSError as exc:
            log.error("radixtier: %s: slot table update failed: %s", self._path, exc)

    # ------------------------------------------------------------------ a put
    def plan_put(self, keys: List[bytes], parents: List[Optional[bytes]],
                 tags: Optional[List[Optional[bytes]]] = None) -> PutPlan:
        """In one lock hold: which keys are stored already (their use counts as recent), which
        repeat a key of this batch, and a slot and a generation for each other key -- a free slot
        or a leaves-first LRU victim's (the victim is gone from the index from here on). Stops at
        the first key with no slot to give (every candidate is being read): the rest are not stored."""
        plan = PutPlan(len(keys))
        first_of: Dict[bytes, int] = {}
        writes = plan.writes
        with self._lock:
            index, order = self._index, self._order
            for i, key in enumerate(keys):
                s = index.get(key)
                if s is not None:
                    plan.ok[i] = True
                    plan.places[i] = s[:4]
                    plan.already += 1
                    order.touch(key)
                    continue
                if key in first_of:
                    plan.dups.append((i, first_of[key]))  # stored only if its first copy is
                    continue
                slot = self._take_slot(plan.evicted)
                if slot is None:
                    break
                first_of[key] = i
                writes.append((i, key, parents[i], slot, 0, None if tags is None else tags[i]))
            if writes:
                g = self._next_gen
                self._next_gen += len(writes)
                plan.writes = [(i, key, parent, slot, g + j, tag)
                               for j, (i, key, parent, slot, _g, tag) in enumerate(writes)]
            if plan.already and plan.evicted:  # found stored, then a later key's victim: not stored after all
                gone = set(plan.evicted)
                for i, key in enumerate(keys):
                    if plan.ok[i] and key in gone:
                        plan.ok[i], plan.places[i] = False, None
                        plan.already -= 1
        plan.settled = bytearray(len(plan.writes))
        return plan

    def _take_slot(self, evicted: List[bytes]) -> Optional[int]:
        """A free slot, or the slot of the next leaves-first LRU victim (appended to `evicted`);
        None when every candidate is being read (lock held)."""
        if self._free:
            return self._free.pop()
        self._apply_touches()
        victim = self._order.next_victim()
        if victim is None:
            return None
        c = self._counters
        if self._order.is_held(victim):
            c.evicted_held += 1
        elif self._order.mode == PLAIN_LRU:
            c.evicted_lru += 1
        else:
            c.evicted_leaves_first += 1
        c.evictions += 1
        s = self._drop(victim)
        evicted.append(victim)
        return s[_SLOT]

    def commit_put(self, plan: PutPlan, status: bytes, sums: Sequence[int], lengths: Sequence[int],
                   entries: bytes) -> None:
        """Written pages become visible: their table entries, made durable, then the index (so a
        page exists for readers, here and after a crash, only once its bytes and entry are on the
        device). `entries` holds each write's packed table entry (ENTRY_BYTES apiece, plan order),
        `status` each write's outcome; a failed write's slot goes back free. Sets plan.ok and
        plan.places; a table that cannot be written fails the whole batch (logged)."""
        entry = memoryview(entries)
        writes = plan.writes
        with self._lock:
            for j, w in enumerate(writes):
                self._set_entry(w[3], entry[j * ENTRY_BYTES:(j + 1) * ENTRY_BYTES] if status[j] == ALL_OK
                                else FREE_ENTRY)
        try:
            self.flush(self._entry_block(w[3]) for w in writes)
            table_ok = True
        except OSError as exc:
            log.error("radixtier: %s", exc)
            table_ok = False
        pages = nbytes = 0
        with self._lock:
            for j, (i, key, parent, slot, gen, _tag) in enumerate(writes):
                if status[j] == ALL_OK and table_ok:
                    placed = (slot, gen, lengths[i], sums[j], parent)
                    self._order.add(key, parent)
                    try:  # in the order and the index, or in neither (abandon_put gives the slot back)
                        self._index[key] = placed
                    except BaseException:
                        self._order.remove(key)
                        raise
                    plan.ok[i] = True
                    plan.places[i] = placed[:4]
                    pages += 1
                    nbytes += lengths[i]
                else:
                    if not table_ok:  # else a later flush of this block would write the entry out
                        self._set_entry(slot, FREE_ENTRY)
                    self._free.append(slot)
                plan.settled[j] = 1
            self._counters.writes += pages
            self._counters.write_bytes += nbytes
        for i, j in plan.dups:
            plan.ok[i], plan.places[i] = plan.ok[j], plan.places[j]

    def refuse_put(self, plan: PutPlan) -> None:
        """No write of the batch may be issued (the lease's deadline passed, or it was lost): every
        slot goes back free with its in-memory entry cleared (a victim's included), so no later
        flush writes a stale entry. The victims stay evicted."""
        with self._lock:
            for w in plan.writes:
                self._set_entry(w[3], FREE_ENTRY)
                self._free.append(w[3])
            plan.settled[:] = b"\x01" * len(plan.writes)

    def abandon_put(self, plan: PutPlan) -> None:
        """After an exception inside a put: the slots not yet settled go back free, exactly once,
        and the put's victims (gone since plan_put, and no PutResult will name them) go to
        take_dropped."""
        with self._lock:
            for j, w in enumerate(plan.writes):
                if not plan.settled[j]:
                    self._set_entry(w[3], FREE_ENTRY)
                    self._free.append(w[3])
                    plan.settled[j] = 1
            self._dropped.extend(plan.evicted)
            plan.evicted = []

    # ------------------------------------------------------------------ a read
    def start_read(self, keys: List[bytes], lengths: List[int]) -> ReadPlan:
        """In one lock hold: the pages held here, each buffer's size checked against its page
        (ValueError naming the first that differs, before anything is pinned), misses counted,
        the read's use noted for the eviction order, and the batch pinned until finish_read."""
        with self._lock:
            found = list(map(self._index.get, keys))
            if None in found:  # read only the pages here: `at` indexes them into keys and buffers
                at: Optional[List[int]] = [i for i, s in enumerate(found) if s is not None]
                keys, found, asked = [keys[i] for i in at], [found[i] for i in at], [lengths[i] for i in at]
            else:  # the usual case, every page here: no Python step per page
                at, asked = None, lengths
            stored = [s[_LENGTH] for s in found]
            if stored != asked:
                j = next(j for j, (a, b) in enumerate(zip(asked, stored)) if a != b)
                raise ValueError(f"get: buffer for page {keys[j].hex()} has {asked[j]} bytes, the stored "
                                 f"page has {stored[j]}")
            self._counters.misses += len(lengths) - len(keys)
            self._touched.extend(keys)  # applied lazily: the order is consulted only for a victim
            if len(self._touched) > _MAX_PENDING_TOUCHES:
                self._apply_touches()
            token = self._order.pin_batch(keys)
        return ReadPlan(keys, found, at, len(lengths), token)

    def finish_read(self, plan: ReadPlan, status: bytes) -> Tuple[List[bool], int]:
        """In one lock hold: the batch unpinned, pages and bytes counted, and each page that failed
        proof or whose I/O failed freed (never read again; logged; its key taken by take_dropped).
        Returns (ok per page asked for, pages whose I/O failed). A page never read (NOT_RUN) is a
        plain miss and stays."""
        ok = [False] * plan.n
        at = plan.at
        found = plan.slots
        if status.count(ALL_OK) == len(plan.keys):  # the usual case: every page proven
            if at is None:
                ok = [True] * plan.n
            else:
                for i in at:
                    ok[i] = True
            with self._lock:
                self._order.unpin_batch(plan.token)
                self._counters.reads += len(plan.keys)
                self._counters.read_bytes += sum(s[_LENGTH] for s in found)
            return ok, 0
        blocks: List[int] = []
        unproven: List[Tuple[bytes, Slot, int]] = []
        io_failed = good_bytes = 0
        for j, st in enumerate(status):
            if st == ALL_OK:
                ok[j if at is None else at[j]] = True
                good_bytes += found[j][_LENGTH]
                continue
            if st in IO_FAILED:
                io_failed += 1
            if st != NOT_RUN:  # never read (the ring failed): a plain miss, the page stays
                unproven.append((plan.keys[j], found[j], st))
        with self._lock:
            self._order.unpin_batch(plan.token)
            c = self._counters
            c.reads += sum(ok)
            c.read_bytes += good_bytes
            if io_failed:
                c.io_errors += 1
            for key, s, st in unproven:
                c.count_unproven(st)
                self._free_unproven(key, s, blocks)
        for key, s, st in unproven:
            log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                        self._path, s[_SLOT], key.hex(), why(st))
        if blocks:
            self._flush_logged(blocks)
        return ok, io_failed

    def _free_unproven(self, key: bytes, s: Slot, blocks: List[int]) -> None:
        """A page that failed proof leaves the index and its slot is freed, so it is never read
        again -- unless the key moved on meanwhile (rewritten) or another reader holds it (lock held)."""
        cur = self._index.get(key)
        if cur is not None and cur[_SLOT] == s[_SLOT] and cur[_GEN] == s[_GEN] and not self._order.is_pinned(key):
            self._drop(key)
            self._set_entry(s[_SLOT], FREE_ENTRY)
            self._free.append(s[_SLOT])
            self._dropped.append(key)
            blocks.append(self._entry_block(s[_SLOT]))

    def count_reads(self, status: bytes, lengths: Sequence[int]) -> None:
        """Counters for pages read by location (another node's slots, which this table does not own)."""
        with self._lock:
            c = self._counters
            for st, n in zip(status, lengths):
                if st == ALL_OK:
                    c.reads += 1
                    c.read_bytes += n
                    continue
                if st in IO_FAILED:
                    c.io_errors += 1
                if st != NOT_RUN:
                    c.count_unproven(st)

    def _apply_touches(self) -> None:
        if self._touched:
            self._order.touch_many(self._touched)
            self._touched.clear()

    def _drop(self, key: bytes) -> Slot:
        s = self._index.pop(key)
        self._order.remove(key)
        return s

    # ------------------------------------------------------------------ removal
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages (not one being read); their table entries are freed on the device.
        Returns how many were removed."""
        blocks: List[int] = []
        with self._lock:
            for key in keys:
                if key not in self._index or self._order.is_pinned(key):
                    continue
                s = self._drop(key)
                self._set_entry(s[_SLOT], FREE_ENTRY)
                self._free.append(s[_SLOT])
                blocks.append(self._entry_block(s[_SLOT]))
        self._flush_logged(blocks)
        return len(blocks)

    def take_dropped(self) -> List[bytes]:
        """Keys freed since the last call outside a put's result: pages a read found unproven, and
        the victims of a put that raised; a put that returns names its victims in its result only."""
        with self._lock:
            out, self._dropped = self._dropped, []
            return out

    # ------------------------------------------------------------------ queries
    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        with self._lock:
            index = self._index
            return [k in index for k in keys]

    def leading_run(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            index = self._index
            n = 0
            for k in keys:
                if k not in index:
                    break
                n += 1
            return n

    def location(self, key: bytes) -> Optional[Tuple[int, int, int, int]]:
        """(slot, generation, length, checksum) of a held page, or None."""
        with self._lock:
            s = self._index.get(key)
            return None if s is None else s[:4]

    def entries(self) -> List[Tuple[bytes, Optional[bytes], Tuple[int, int, int, int]]]:
        """(key, parent, (slot, generation, length, checksum)) of every held page, at one moment."""
        with self._lock:
            return [(key, s[_PARENT], s[:4]) for key, s in self._index.items()]

    def table_copy(self) -> Tuple[bytes, int]:
        """(a copy of this partition's slot table as committed, its first slot), at one moment."""
        with self._lock:
            return bytes(self._table), self._range.start

    def held_at(self, keys: Sequence[bytes], places: Sequence[Tuple[int, int]]) -> List[bool]:
        """Per page: whether keys[i] is held now at places[i] (slot, generation)."""
        out = []
        with self._lock:
            index = self._index
            for key, (slot, gen) in zip(keys, places):
                s = index.get(key)
                out.append(s is not None and s[_SLOT] == slot and s[_GEN] == gen)
        return out

    def keys(self) -> List[bytes]:
        with self._lock:
            return list(self._index)

    def hold(self, keys: Sequence[bytes], held: bool) -> None:
        with self._lock:
            for k in keys:
                k = bytes(k)
                if k in self._index:
                    self._order.hold(k, held)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._order.touch(k)

    def peek_victim(self) -> Optional[bytes]:
        """The page a put would evict next (tests and tools)."""
        with self._lock:
            self._apply_touches()
            return self._order.peek_victim()

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)
