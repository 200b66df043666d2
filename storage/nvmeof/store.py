"""NvmeofPageStore: the tier-3 page store on an NVMe-oF namespace (block device) or a file.

What it guarantees:
- a read returns a page only after proving it: slot header (key, generation, length, slot,
  namespace uuid, crc) and payload checksum all match; anything else is a miss and the slot
  is freed, so a torn, stale or corrupt page is never served;
- a page is durable before the slot table (the on-device key->slot index) names it, and the
  table is what a restarted process recovers from; after an unclean stop every recovered
  entry is re-checked against its slot header before it is believed;
- I/O is parallel (`queue_depth` in flight, io_uring or a preadv/pwritev pool), adjacent
  slots are coalesced into one vectored I/O, and aligned caller buffers are read into
  directly with O_DIRECT (unaligned ones go through an aligned bounce buffer);
- when full it evicts leaves first, least recently used first, over the hash chain (the
  tree's order), never a page that is being read;
- several nodes may attach one namespace: each writes only its own partition (a slot range
  and its own table blocks) and reads any slot by (slot, generation), verified.
"""

from __future__ import annotations

import errno
import logging
from operator import itemgetter
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from radixtier.storage.checksum import checksum
from radixtier.storage.eviction import EVICTION_MODES, LEAVES_FIRST, PLAIN_LRU, EvictionOrder
from radixtier.storage.nvmeof.io_engine import (IOV_MAX, MAX_QUEUE_DEPTH, IOOp, aligned_buffer, deadline_check_reason,
                                                make_engine)
from radixtier.storage.nvmeof.layout import (BLOCK, ENTRY_BYTES, FREE_ENTRY, HEADER_BYTES, KEY_BYTES, FormatError,
                                             SlotHeader, Superblock, TableEntry, align_up)
from radixtier.storage.nvmeof.lease import DEFAULT_LEASE_S, PartitionLease, check_timing, default_io_timeout_s
from radixtier.storage.nvmeof.reading import PagesInRead
from radixtier.storage.api import BufferLike, PageLocation, PutResult, buffer_address, buffer_view
from radixtier.storage.nvmeof.target import open_target, read_aligned, reserve_file_space, write_aligned
from radixtier.storage.validate import VERIFY_MODES, one_of, positive_int
from radixtier.storage.validate import node_id as validate_node_id

log = logging.getLogger("radixtier.storage.nvmeof")

DEFAULT_COALESCE_BYTES = 1 << 20  # largest vectored I/O built from adjacent slots
_MAX_PENDING_TOUCHES = 4096  # read keys waiting to reach the eviction order (applying them holds the lock ~5 ms)
_FAILURE = {1: "I/O error", 2: "slot header does not match: torn or foreign",
            3: "payload checksum mismatch: torn or corrupt", 4: "not read: the I/O ring failed",
            5: "stale: the slot holds another page or generation"}
_FAILURE_COUNTER = {2: "corrupt_header", 3: "corrupt_checksum", 5: "corrupt_stale"}


# Where a held page is: (slot, generation, length, checksum, parent key or None). A plain tuple of
# atoms, not an object: CPython's collector stops tracking such tuples, so a store holding millions
# of pages adds nothing to the full collections that pause every thread of an SGLang process.
_Slot = Tuple[int, int, int, int, Optional[bytes]]
SLOT, GEN, LENGTH, CSUM, PARENT = range(5)
_LENGTH_OF = itemgetter(LENGTH)


class _CallGate:
    """Counts calls that may reach the device; close() waits for them, and none starts after it.
    (A transfer thread of SGLang may still be inside get/put when the backend is closed.)"""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._active = 0
        self._closing = False

    @contextmanager
    def call(self, path: str):
        with self._cv:
            if self._closing:
                raise RuntimeError(f"{path}: the page store is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @property
    def closing(self) -> bool:
        with self._cv:
            return self._closing

    def close(self, timeout: float) -> bool:
        """Refuse new calls; True once the running ones finished (False: still running at timeout)."""
        with self._cv:
            self._closing = True
            return self._cv.wait_for(lambda: self._active == 0, timeout=timeout)


@dataclass
class StoreCounters:
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

    def as_dict(self) -> Dict[str, int]:
        return dict(self.__dict__)


def _segments(buf, writable: bool = False) -> List[memoryview]:
    """A page buffer, or a list of segments (e.g. SGLang's K and V pointers for one page)."""
    try:
        if isinstance(buf, list) or (isinstance(buf, tuple) and not (len(buf) == 2 and all(isinstance(x, int) for x in buf))):
            segs = [buffer_view(b) for b in buf]
        else:
            segs = [buffer_view(buf)]
    except TypeError:
        raise ValueError(f"buffer: expected a CPU tensor, a buffer or (address, nbytes), got "
                         f"{type(buf).__name__}") from None
    if writable and any(s.readonly for s in segs):
        raise ValueError(f"buffer: a {type(buf).__name__} is read-only; get() needs writable buffers to read into")
    return segs


def _check_keys(keys: Sequence[bytes]) -> List[bytes]:
    """_check_key of each key, with the common case (16 bytes already) tested first: it runs per page."""
    return [k if type(k) is bytes and len(k) == KEY_BYTES else _check_key(k) for k in keys]


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ValueError(f"key: expected {KEY_BYTES} bytes (a page hash), got {type(key).__name__} "
                         f"of length {len(key) if hasattr(key, '__len__') else '?'}")
    return bytes(key)


def format_namespace(path: str, page_bytes: int, capacity_bytes: Optional[int] = None, partitions: int = 1,
                     force: bool = False, direct: bool = True) -> Superblock:
    """Write a fresh superblock and empty tables. Refuses to overwrite anything unless force=True.

    A format that fails leaves nothing behind: a file it created is removed, and a target that
    existed keeps whatever superblock it had until the new one is complete (it is written last).
    """
    positive_int("page_bytes", page_bytes)
    if capacity_bytes is not None:
        positive_int("capacity", capacity_bytes)
    exists = os.path.exists(path)
    if not exists and capacity_bytes is None:
        raise ValueError(f"capacity: required to create the file namespace {path}")
    if not exists:  # fail before creating anything when the geometry cannot work
        Superblock.plan(page_bytes, capacity_bytes, partitions, 0)
    try:
        return _format(path, page_bytes, capacity_bytes, partitions, force, direct, exists)
    except BaseException:
        if not exists and os.path.isfile(path):
            os.remove(path)
        raise


def _format(path: str, page_bytes: int, capacity_bytes: Optional[int], partitions: int, force: bool,
            direct: bool, exists: bool) -> Superblock:
    t = open_target(path, create_bytes=capacity_bytes or 0, direct=direct)
    try:
        if not force and exists and t.size > 0:
            head = read_aligned(t, 0, BLOCK)
            try:
                sb = Superblock.unpack(head, path)
                raise FormatError(f"{path}: already a radixtier namespace (uuid {sb.uuid}, page_bytes "
                                  f"{sb.page_bytes}, {sb.slot_count} slots); pass --force to erase it")
            except FormatError as exc:
                if "already" in str(exc):
                    raise
                if any(head):
                    raise FormatError(f"{path}: holds other data (block 0 is not empty); "
                                      f"pass --force to overwrite it") from None
        total = t.size if capacity_bytes is None else capacity_bytes
        if total > t.size:
            if t.is_block:
                raise ValueError(f"capacity: {total} bytes asked, device {path} has {t.size}")
            os.ftruncate(t.fd, total)
        if not t.is_block:
            why = reserve_file_space(t, total)
            if why:
                log.info("radixtier: %s stays sparse: %s", path, why)
        sb = Superblock.plan(page_bytes, total, partitions, time.time_ns())
        zero = aligned_buffer(1 << 20)
        off, end = BLOCK, sb.data_offset  # owner table + slot table
        while off < end:
            n = min(len(zero), end - off)
            os.pwritev(t.fd, [zero[:n]], off)
            off += n
        os.fsync(t.fd)
        write_aligned(t, 0, sb.pack())  # the superblock goes last: a half-formatted target has none
        os.fsync(t.fd)
        return sb
    finally:
        t.close()


def read_superblock(path: str) -> Superblock:
    t = open_target(path, direct=False, readonly=True)
    try:
        return Superblock.unpack(read_aligned(t, 0, BLOCK), path)
    finally:
        t.close()


class NvmeofPageStore:
    """Tier-3 page store over one partition of a namespace (see module docstring)."""

    def __init__(self, path: str, page_bytes: Optional[int] = None, *, partition: int = 0,
                 node_id: str = "local", create_bytes: int = 0, partitions: int = 1,
                 io_engine: str = "auto", queue_depth: int = 16, direct: bool = True, sync: bool = True,
                 eviction: str = LEAVES_FIRST, verify: str = "auto",
                 coalesce_bytes: int = DEFAULT_COALESCE_BYTES, lease_s: float = DEFAULT_LEASE_S,
                 force_takeover: bool = False, lease_io_timeout_s: Optional[float] = None) -> None:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValueError(f"path: expected the path of a block device or file, got {path!r}")
        one_of("eviction", eviction, EVICTION_MODES)
        one_of("verify", verify, VERIFY_MODES)
        validate_node_id("node_id", node_id)
        if page_bytes is not None:
            positive_int("page_bytes", page_bytes)
        if create_bytes:
            positive_int("capacity", create_bytes)
        positive_int("coalesce_bytes", coalesce_bytes)
        positive_int("queue_depth", queue_depth, MAX_QUEUE_DEPTH)
        self.lease_s, self.lease_io_timeout_s = check_timing(
            lease_s, default_io_timeout_s() if lease_io_timeout_s is None else lease_io_timeout_s)
        self.path = path
        self.node_id = node_id
        self.sync = sync
        self.coalesce_bytes = coalesce_bytes
        if not os.path.exists(path) or (create_bytes and os.path.isfile(path) and os.path.getsize(path) == 0):
            if not create_bytes or page_bytes is None:
                raise FileNotFoundError(f"path: {path} is not a formatted namespace; give page_bytes and "
                                        f"create_bytes to create one, or run `radixtier format`")
            format_namespace(path, page_bytes, create_bytes, partitions, direct=direct)
        self._t = open_target(path, direct=direct)
        self._gate = _CallGate()
        self._lease: Optional[PartitionLease] = None
        self._engine = None
        try:
            self._open(page_bytes, partition, verify, eviction, io_engine, queue_depth, force_takeover)
        except BaseException:
            if self._lease is not None:
                self._lease.release("restore")  # an open that failed leaves the record as it found it
            if self._engine is not None:
                self._engine.close()
            self._t.close()
            raise

    # ---------------------------------------------------------------- opening and recovery
    def _open(self, page_bytes, partition, verify, eviction, io_engine, queue_depth, force_takeover) -> None:
        sb = Superblock.unpack(read_aligned(self._t, 0, BLOCK), self.path)
        if page_bytes is not None and sb.page_bytes != page_bytes:
            raise FormatError(f"{self.path}: formatted with page_bytes={sb.page_bytes}, asked for "
                              f"page_bytes={page_bytes}; reformat it (`radixtier format --force`) or use "
                              f"a matching page size")
        if sb.total_bytes > self._t.size:
            raise FormatError(f"{self.path}: superblock describes {sb.total_bytes} bytes, target has {self._t.size}")
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < sb.partitions:
            raise ValueError(f"partition: expected 0..{sb.partitions - 1} for {self.path}, got {partition!r}")
        self.sb = sb
        self.uuid = sb.uuid
        self.page_bytes = sb.page_bytes
        self.partition = partition
        self._range = sb.partition_range(partition)
        self.capacity_pages = len(self._range)
        lease = PartitionLease(self._t, sb, partition, self.node_id, lease_s=self.lease_s,
                               io_timeout_s=self.lease_io_timeout_s, force=force_takeover)
        lease.acquire()  # before anything is read or written: a held partition is refused here
        self._lease = lease
        self._engine = make_engine(io_engine, queue_depth)
        unchecked = deadline_check_reason()
        if unchecked:
            log.warning("radixtier: %s", unchecked)
        self.io_engine = self._engine.name
        self.direct = self._t.direct
        self._native = self._engine.native_pages
        self._uuid_bytes = bytes.fromhex(sb.uuid)
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._table_lock = threading.Lock()
        self._index: Dict[bytes, _Slot] = {}
        self._order = EvictionOrder(eviction)
        self._readers = PagesInRead()  # pages being read now: never chosen as victims, never dropped
        self._touched: List[bytes] = []  # pages read since the eviction order last caught up
        self._evicted: List[bytes] = []
        prev = self._lease.previous
        if prev is not None and prev.node_id != self.node_id:
            log.warning("radixtier: %s partition %d was owned by node %r; node %r takes it over",
                        self.path, partition, prev.node_id, self.node_id)
        unclean = self._lease.unclean
        first = self._range.start
        nbytes = len(self._range) * ENTRY_BYTES
        self._table_base = sb.entry_offset(first)
        self._table = bytearray(read_aligned(self._t, self._table_base, nbytes))
        used = []
        for i in range(len(self._range)):
            e = TableEntry.unpack(bytes(self._table[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES]))
            if e is not None and e.length <= sb.page_bytes:
                used.append((first + i, e))
        mode = verify if verify != "auto" else ("headers" if unclean else "none")
        self.recovery = {"entries": len(used), "dropped": 0, "verify": mode, "unclean": unclean,
                         "lease_waited_s": round(self._lease.waited_s, 3)}
        if mode != "none":
            bad = self._verify_slots(used, full=(mode == "full"))
            self.recovery["dropped"] = len(bad)
            if bad:
                for slot in bad:
                    self._set_entry(slot, FREE_ENTRY)
                self._flush_table(sorted({self._entry_block(s) for s in bad}))
                used = [(s, e) for s, e in used if s not in bad]
        gen = 0
        for slot, e in sorted(used, key=lambda se: se[1].generation):
            if e.key in self._index:  # two slots claim one key: keep the newer
                old = self._index.pop(e.key)
                self._set_entry(old[SLOT], FREE_ENTRY)
            self._index[e.key] = (slot, e.generation, e.length, e.checksum, e.parent)
            gen = max(gen, e.generation)
        for key, s in self._index.items():
            self._order.add(key, None)
        for key, s in self._index.items():
            if s[PARENT] is not None:
                self._order.set_parent(key, s[PARENT])
        taken = {s[SLOT] for s in self._index.values()}
        self._free = [s for s in reversed(self._range) if s not in taken]
        self._next_gen = gen + 1
        if self.recovery["entries"]:
            log.info("radixtier: %s partition %d: recovered %d pages (%d dropped, verify=%s)", self.path,
                     partition, len(self._index), self.recovery["dropped"], mode)

    @property
    def fenced(self) -> str:
        """Why this store may not write its partition now ('' while it may): another opener took
        the lease (for good), or its write deadline passed without a renewal (until one succeeds).
        Reads stay verified and safe. Every write is also issued against the lease's deadline
        (checked in C right before each submission), so a pause after this check changes nothing."""
        return self._lease.lost if self._lease is not None else ""

    def _verify_slots(self, used: List[Tuple[int, TableEntry]], full: bool) -> set:
        """Slots whose header (and, if full, payload) does not match their table entry."""
        bad = set()
        batch = 256
        for i in range(0, len(used), batch):
            part = used[i:i + batch]
            size = HEADER_BYTES + (align_up(self.sb.page_bytes) if full else 0)
            buf = aligned_buffer(size * len(part))
            ops = [IOOp(False, self._t.fd, self.sb.slot_offset(s), [buf[j * size:(j + 1) * size]])
                   for j, (s, _e) in enumerate(part)]
            res = self._engine.run(ops)
            for j, ((slot, e), r) in enumerate(zip(part, res)):
                view = buf[j * size:(j + 1) * size]
                if r < size or not self._header_ok(view, slot, e.key, e.generation, e.length, e.checksum):
                    bad.add(slot)
                elif full and checksum(view[HEADER_BYTES:HEADER_BYTES + e.length]) != e.checksum:
                    bad.add(slot)
        return bad

    # ---------------------------------------------------------------- table
    def _entry_block(self, slot: int) -> int:
        return (slot - self._range.start) * ENTRY_BYTES // BLOCK

    def _set_entry(self, slot: int, packed: BufferLike) -> None:
        """A slot's entry in the in-memory table: a packed TableEntry, or FREE_ENTRY."""
        i = (slot - self._range.start) * ENTRY_BYTES
        self._table[i:i + ENTRY_BYTES] = packed

    def _flush_table(self, blocks: Sequence[int]) -> None:
        """Write table blocks (whole 4 KiB blocks from the in-memory copy), then make them durable."""
        if not blocks:
            return
        with self._table_lock:
            deadline = self._lease.write_deadline()  # OSError when no write may be issued
            ops, runs = [], []
            for b in sorted(set(blocks)):
                if runs and runs[-1][1] == b:
                    runs[-1][1] = b + 1
                else:
                    runs.append([b, b + 1])
            for lo, hi in runs:
                buf = aligned_buffer((hi - lo) * BLOCK)
                with self._lock:
                    buf[:] = self._table[lo * BLOCK:hi * BLOCK]
                ops.append(IOOp(True, self._t.fd, self._table_base + lo * BLOCK, [buf]))
            res = self._engine.run(ops, None, deadline)
            if any(r < op.nbytes for r, op in zip(res, ops)):
                self.counters.io_errors += 1
                raise OSError(f"{self.path}: slot table write failed")
            if self.sync:
                os.fdatasync(self._t.fd)

    def _flush_table_logged(self, blocks: Sequence[int]) -> None:
        """_flush_table for removals: on failure the entries stay on the device, where the next open
        re-checks them against their slot headers (a removed page is never served wrongly)."""
        try:
            self._flush_table(blocks)
        except OSError as exc:
            log.error("radixtier: %s: slot table update failed: %s", self.path, exc)

    # ---------------------------------------------------------------- queries
    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        keys = _check_keys(keys)
        with self._lock:
            return [k in self._index for k in keys]

    def leading_run(self, keys: Sequence[bytes]) -> int:
        keys = _check_keys(keys)
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
            return n

    def location(self, key: bytes) -> Optional[PageLocation]:
        key = _check_key(key)
        with self._lock:
            s = self._index.get(key)
            return None if s is None else PageLocation(self.uuid, s[SLOT], s[GEN], s[LENGTH], s[CSUM])

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]:
        with self._lock:
            items = list(self._index.items())
        for key, s in items:
            yield key, s[PARENT], PageLocation(self.uuid, s[SLOT], s[GEN], s[LENGTH], s[CSUM])

    def touch(self, keys: Sequence[bytes]) -> None:
        keys = _check_keys(keys)
        with self._lock:
            for k in keys:
                self._order.touch(k)

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None:
        """A faster tier holds these pages (or no longer does): held pages are the first victims,
        even ahead of their children, since their prefix stays reachable from that tier."""
        with self._lock:
            for k in keys:
                k = bytes(k)
                if k in self._index:
                    self._order.hold(k, held)

    def take_evicted(self) -> List[bytes]:
        with self._lock:
            out, self._evicted = self._evicted, []
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def stats(self) -> Dict[str, object]:
        with self._lock:
            used = len(self._index)
        return {"path": self.path, "uuid": self.uuid, "partition": self.partition, "page_bytes": self.page_bytes,
                "capacity_pages": self.capacity_pages, "used_pages": used, "io_engine": self.io_engine,
                "direct_io": self.direct, "fixed_ios": self._engine.fixed_ios(), **self.counters.as_dict()}

    def register_memory(self, regions: Sequence[Tuple[int, int]]) -> bool:
        """Host memory that reads land in (SGLang's host pool, as (address, nbytes) regions), to be
        registered once with io_uring so large page segments in it are read without per-I/O page
        pinning. True when registered; False on the thread-pool engine, when the kernel refused
        (logged), for [] (which takes the memory back) and once the store is closed. The memory must
        stay mapped until register_memory([]) or close()."""
        if self._gate.closing:  # e.g. a cache giving its pool back after the store was closed
            return False
        with self._gate.call(self.path):  # close() waits for a registration under way
            return self._engine.register_memory(regions)

    # ---------------------------------------------------------------- writes
    def put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
            parents: Optional[Sequence[Optional[bytes]]] = None) -> PutResult:
        """Write pages; ok[i] is True once page i is durable and indexed (or was already stored)."""
        with self._gate.call(self.path):
            return self._put(keys, buffers, parents)

    def _put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
             parents: Optional[Sequence[Optional[bytes]]]) -> PutResult:
        keys = _check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(buffers)} buffers")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(parents)} parents")
        parent_keys = [None] * len(keys) if parents is None else [None if p is None else _check_key(p) for p in parents]
        if self._native:
            batch = self._engine.page_batch(buffers, writable=False)
            try:
                return self._put_checked(keys, batch.lengths(), [None] * len(keys), parent_keys, batch)
            finally:
                batch.close()
        segs = [_segments(b) for b in buffers]
        return self._put_checked(keys, [sum(s.nbytes for s in sg) for sg in segs], segs, parent_keys, None)

    def _put_checked(self, keys: List[bytes], lengths: List[int], segs: List[Optional[List[memoryview]]],
                     parent_keys: List[Optional[bytes]], batch) -> PutResult:
        """put() once the buffers are in hand: `segs` for the Python path, `batch` for the native one."""
        for k, n in zip(keys, lengths):
            if n > self.page_bytes or n == 0:
                raise ValueError(f"put: page {k.hex()} has {n} bytes; this namespace holds pages of "
                                 f"at most {self.page_bytes} bytes")
        ok = [False] * len(keys)
        evicted: List[bytes] = []
        if self.fenced:  # another opener holds the partition now: writing would destroy its pages
            self.counters.fenced_writes += len(keys)
            return PutResult(ok, evicted)
        plan: List[Tuple[int, bytes, Optional[bytes], int, List[memoryview]]] = []  # (i, key, parent, slot, segs)
        first_of: Dict[bytes, int] = {}  # key -> index of its first copy in this batch
        dups: List[Tuple[int, int]] = []  # (index, index of the copy that is written)
        already = 0
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._index:
                    ok[i] = True
                    already += 1
                    self._order.touch(key)
                    continue
                if key in first_of:
                    dups.append((i, first_of[key]))  # stored only if its first copy is
                    continue
                slot = self._take_slot(evicted)
                if slot is None:
                    break  # full of pages being read: the rest of this batch is not stored
                first_of[key] = i
                plan.append((i, key, parent_keys[i], slot, segs[i]))
        if plan:
            try:
                if batch is not None:
                    self._write_planned_native(batch, lengths, plan, ok)
                else:
                    self._write_planned(plan, ok)
            except BaseException:
                with self._lock:  # slots of pages that did not become visible go back
                    self._free.extend(slot for _i, key, _p, slot, _sg in plan
                                      if (self._index.get(key) or (None,))[SLOT] != slot)
                raise
        for i, j in dups:
            ok[i] = ok[j]
        return PutResult(ok, evicted, already, sum(ok[p[0]] for p in plan))

    def _write_planned(self, plan: List[Tuple[int, bytes, Optional[bytes], int, List[memoryview]]],
                       ok: List[bool]) -> None:
        """Data, then durability, then the table entries, then the in-memory index: a page exists
        for readers (here and after a crash) only once its bytes are on the device."""
        gens = self._generations(len(plan))
        ops, entries, placed, bounce_bytes = [], [], [], 0
        headers = aligned_buffer(HEADER_BYTES * len(plan))
        for j, (i, key, parent, slot, sg) in enumerate(plan):
            length = sum(s.nbytes for s in sg)
            csum = checksum(*sg)
            hdr = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
            SlotHeader(gens[j], length, csum, slot, key, parent, self.uuid).pack_into(hdr)
            entries.append(TableEntry(key, parent, gens[j], length, csum).pack())
            placed.append((slot, gens[j], length, csum, parent))
            payload = self._direct_segments(sg, length)
            if payload is None:
                bounce = aligned_buffer(align_up(length))
                pos = 0
                for s in sg:
                    bounce[pos:pos + s.nbytes] = s
                    pos += s.nbytes
                payload = [bounce]
                bounce_bytes += length
            ops.append((slot, [hdr] + payload))
        if bounce_bytes:
            self.counters.bounced += 1
        try:
            deadline = self._lease.write_deadline()
        except OSError as exc:
            self._refuse_planned(plan, exc)
            return
        try:
            results = self._run_coalesced(True, ops, deadline=deadline)
        except OSError as exc:
            if exc.errno != errno.ETIME:
                raise
            self._fenced_during_write(len(plan), exc)
            results = [False] * len(plan)  # what landed stays in free slots: no entry names it
        if self.sync:
            os.fdatasync(self._t.fd)
        self._commit_written(plan, b"".join(entries), placed, results, ok)

    def _commit_written(self, plan: list, entries: bytes, placed: List[_Slot], results: List[bool],
                        ok: List[bool]) -> None:
        """Written pages become visible: table entries, made durable, then the in-memory index.
        `entries` holds each planned page's packed table entry (ENTRY_BYTES apiece, plan order) and
        `placed` its index tuple: a batch is committed without building an object per page."""
        entry = memoryview(entries)
        with self._lock:
            for j, (_i, _key, _parent, slot, _sg) in enumerate(plan):
                self._set_entry(slot, entry[j * ENTRY_BYTES:(j + 1) * ENTRY_BYTES] if results[j] else FREE_ENTRY)
        try:
            self._flush_table({self._entry_block(slot) for _i, _k, _p, slot, _sg in plan})
            table_ok = True
        except OSError as exc:
            log.error("radixtier: %s", exc)
            table_ok = False
        pages = nbytes = 0
        with self._lock:
            for j, (i, key, parent, slot, _sg) in enumerate(plan):
                if results[j] and table_ok:
                    self._index[key] = placed[j]
                    self._order.add(key, parent)
                    ok[i] = True
                    pages += 1
                    nbytes += placed[j][LENGTH]
                else:
                    if not table_ok:  # else a later flush of this block would write the entry out
                        self._set_entry(slot, FREE_ENTRY)
                    self._free.append(slot)
            self.counters.writes += pages
            self.counters.write_bytes += nbytes

    def _write_planned_native(self, batch, lengths: List[int],
                              plan: List[Tuple[int, bytes, Optional[bytes], int, None]], ok: List[bool]) -> None:
        """_write_planned on the native core: checksums, headers, the writes and the packed table
        entries run in C (GIL released); then durability, table entries and the index, in the same order."""
        gens = self._generations(len(plan))
        try:
            deadline = self._lease.write_deadline()
        except OSError as exc:
            self._refuse_planned(plan, exc)
            return
        status, sums, entries, err = self._engine.write_pages(
            batch, self._t.fd, self.sb.data_offset, self.sb.slot_bytes, self._uuid_bytes,
            [(i, key, parent, slot, gens[j]) for j, (i, key, parent, slot, _sg) in enumerate(plan)],
            self.coalesce_bytes, self.direct, deadline)
        if any(status) and (err == errno.ETIME or self.fenced):
            self._fenced_during_write(sum(1 for x in status if x), OSError(errno.ETIME, self.fenced or "write deadline"))
        elif any(status):
            self.counters.io_errors += 1
            log.error("radixtier: %s: write of %d page(s) failed: %s", self.path, sum(1 for x in status if x),
                      os.strerror(err or 5))
        if self.sync:
            os.fdatasync(self._t.fd)
        placed = [(slot, gens[j], lengths[i], sums[j], parent) for j, (i, _key, parent, slot, _sg) in enumerate(plan)]
        self._commit_written(plan, entries, placed, [st == 0 for st in status], ok)

    def _refuse_planned(self, plan: list, exc: OSError) -> None:
        """put()'s check passed but no write may be issued now (the lease's deadline passed, or it
        was lost): nothing of the batch is written. Its slots go back free with their in-memory
        entries cleared (an evicted victim's included), so no later flush writes a stale entry."""
        self._fenced_during_write(len(plan), exc)
        with self._lock:
            for _i, _key, _parent, slot, _sg in plan:
                self._set_entry(slot, FREE_ENTRY)
                self._free.append(slot)

    def _fenced_during_write(self, pages: int, exc: OSError) -> None:
        """The lease's deadline passed (or it was lost) between put()'s check and the writes."""
        self.counters.fenced_writes += pages
        log.warning("radixtier: %s: %d page(s) not written: %s", self.path, pages, exc.strerror or exc)

    def _generations(self, n: int) -> List[int]:
        with self._lock:
            g = self._next_gen
            self._next_gen += n
        return list(range(g, g + n))

    def _take_slot(self, evicted: List[bytes]) -> Optional[int]:
        """A free slot, or the slot of the next leaves-first LRU victim (called under the lock)."""
        if self._free:
            return self._free.pop()
        self._apply_touches()
        victim = self._order.peek_victim()
        for _ in range(len(self._readers)):  # a page being read is not taken: the next in line goes
            if victim is None or victim not in self._readers:
                break
            self._order.touch(victim)
            victim = self._order.peek_victim()
        if victim is None or victim in self._readers:
            return None
        reason = "evicted_held" if self._order.is_held(victim) else (
            "evicted_lru" if self._order.mode == PLAIN_LRU else "evicted_leaves_first")
        s = self._drop(victim)
        evicted.append(victim)
        self._evicted.append(victim)
        self.counters.evictions += 1
        setattr(self.counters, reason, getattr(self.counters, reason) + 1)
        return s[SLOT]

    def _note_reads(self, keys: List[bytes]) -> None:
        """Reads count as recent use, applied to the eviction order lazily (under the lock): the
        order is only consulted when a victim is chosen, so the read path only appends keys."""
        self._touched.extend(keys)
        if len(self._touched) > _MAX_PENDING_TOUCHES:
            self._apply_touches()

    def _apply_touches(self) -> None:
        if self._touched:
            self._order.touch_many(self._touched)
            self._touched.clear()

    def _drop(self, key: bytes) -> _Slot:
        s = self._index.pop(key)
        self._order.remove(key)
        return s

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._gate.call(self.path):
            return self._delete(keys)

    def _delete(self, keys: Sequence[bytes]) -> int:
        keys = _check_keys(keys)
        blocks = []
        with self._lock:
            for k in keys:
                if k in self._index and k not in self._readers:
                    s = self._drop(k)
                    self._set_entry(s[SLOT], FREE_ENTRY)
                    self._free.append(s[SLOT])
                    blocks.append(self._entry_block(s[SLOT]))
        self._flush_table_logged(blocks)
        return len(blocks)

    def clear(self) -> int:
        with self._lock:
            keys = list(self._index)
        return self.delete(keys)

    # ---------------------------------------------------------------- reads
    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        """Read pages into caller buffers; ok[i] is True only for a page proven intact."""
        with self._gate.call(self.path):
            return self._get(keys, buffers)

    def _get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        keys = _check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(buffers)} buffers")
        if self._native:
            return self._get_native(keys, buffers)
        segs = [_segments(b, writable=True) for b in buffers]
        ok = [False] * len(keys)
        plan = []
        with self._lock:
            for i, key in enumerate(keys):  # every size checked before any page is pinned
                s = self._index.get(key)
                if s is not None and sum(x.nbytes for x in segs[i]) != s[LENGTH]:
                    raise ValueError(f"get: buffer for page {key.hex()} has {sum(x.nbytes for x in segs[i])} "
                                     f"bytes, the stored page has {s[LENGTH]}")
            for i, key in enumerate(keys):
                s = self._index.get(key)
                if s is None:
                    self.counters.misses += 1
                    continue
                plan.append((i, key, s))
            pinned = [key for _i, key, _s in plan]
            self._note_reads(pinned)
            reading = self._readers.begin(pinned)  # the last step before the try that ends it
        good = [False] * len(plan)
        try:
            good = self._read_verified([(s[SLOT], key, s[GEN], s[LENGTH], s[CSUM], segs[i])
                                        for i, key, s in plan])
        finally:
            with self._lock:
                self._readers.end(reading)
        blocks = []
        with self._lock:
            for (i, key, s), g in zip(plan, good):
                if g:
                    ok[i] = True
                    continue
                self._free_unproven(key, s, blocks)
        if blocks:
            self._flush_table_logged(blocks)
        return ok

    def _get_native(self, keys: List[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        """get() on the native core: one export of every buffer, then the whole batch (plan, I/O,
        header and CRC proof per page) in C with the GIL released; Python does only the index, and
        names the pages by parallel lists (no object per page for a full GC to walk later)."""
        batch = self._engine.page_batch(buffers, writable=True)
        try:
            lengths = batch.lengths()
            with self._lock:
                slots = list(map(self._index.get, keys))
                if None in slots:  # read only the pages here: `held` indexes them into keys and buffers
                    held: Optional[List[int]] = [i for i, s in enumerate(slots) if s is not None]
                    keys, slots, asked = [keys[i] for i in held], [slots[i] for i in held], [lengths[i] for i in held]
                else:  # the usual case, every page here: no Python step per page
                    held, asked = None, lengths
                stored = list(map(_LENGTH_OF, slots))
                if stored != asked:  # every size checked before any page is pinned
                    j = next(j for j, (a, b) in enumerate(zip(asked, stored)) if a != b)
                    raise ValueError(f"get: buffer for page {keys[j].hex()} has {asked[j]} bytes, the stored "
                                     f"page has {stored[j]}")
                self.counters.misses += len(lengths) - len(keys)
                self._note_reads(keys)
                reading = self._readers.begin(keys)  # the last step before the try that ends it
            status, err = b"\x04" * len(keys), 0
            try:
                status, err = self._read_batch(batch, keys, slots, held)
            finally:
                with self._lock:
                    self._readers.end(reading)
        finally:
            batch.close()
        ok = [False] * len(lengths)
        if status.count(0) == len(keys):  # the usual case: every page proven
            if held is None:
                ok = [True] * len(lengths)
            else:
                for i in held:
                    ok[i] = True
            with self._lock:
                self.counters.reads += len(keys)
                self.counters.read_bytes += sum(stored)
            return ok
        at = range(len(keys)) if held is None else held  # page j of the read is page at[j] of the call
        bad, good_bytes = [], 0
        for j, st in enumerate(status):
            if st == 0:
                ok[at[j]] = True
                good_bytes += stored[j]
            elif st != 4:  # 4: never read (the ring failed): a plain miss, the page stays
                bad.append(j)
        with self._lock:
            self.counters.reads += sum(ok)
            self.counters.read_bytes += good_bytes
            if any(st in (1, 4) for st in status):
                self.counters.io_errors += 1
        if any(st in (1, 4) for st in status):
            log.error("radixtier: %s: read of %d page(s) failed: %s", self.path,
                      sum(1 for st in status if st in (1, 4)), os.strerror(err or 5))
        self._drop_unproven([(at[j], keys[j], slots[j]) for j in bad], [status[j] for j in bad])
        return ok

    def _read_batch(self, batch, keys: List[bytes], slots: List[_Slot], held: Optional[List[int]]):
        """The native core's verified read of keys[j] at slots[j] into batch page held[j] (or j) from
        this store's device and geometry: (status per page, first errno)."""
        return self._engine.read_pages(batch, self._t.fd, self.sb.data_offset, self.sb.slot_bytes,
                                       self._uuid_bytes, keys, slots, held, self.coalesce_bytes, self.direct)

    def _drop_unproven(self, failed: List[Tuple[int, bytes, _Slot]], why: Sequence[int]) -> None:
        """Pages a read could not prove: counted, logged, and their slots freed (never read again)."""
        blocks = []
        with self._lock:
            for (_i, key, s), st in zip(failed, why):
                self._count_failure(st)
                log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                            self.path, s[SLOT], key.hex(), _FAILURE.get(st, "torn, stale or corrupt"))
                self._free_unproven(key, s, blocks)
        if blocks:
            self._flush_table_logged(blocks)

    def _free_unproven(self, key: bytes, s: _Slot, blocks: List[int]) -> None:
        """A page that failed proof leaves the index and its slot is freed, so it is never read
        again -- unless the key moved on meanwhile (rewritten) or another reader holds it (called
        under the lock; the table blocks to flush are appended to `blocks`)."""
        cur = self._index.get(key)
        if cur is not None and cur[SLOT] == s[SLOT] and cur[GEN] == s[GEN] and key not in self._readers:
            self._drop(key)
            self._set_entry(s[SLOT], FREE_ENTRY)
            self._free.append(s[SLOT])
            self._evicted.append(key)
            blocks.append(self._entry_block(s[SLOT]))

    def read_location(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool:
        """Read a page any node wrote in this namespace, by (slot, generation), verified."""
        with self._gate.call(self.path):
            return self._read_location(location, key, buffer)

    def _read_location(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool:
        if location.namespace != self.uuid or not 0 <= location.slot < self.sb.slot_count:
            return False
        if location.length > self.page_bytes:
            return False
        key = _check_key(key)
        if self._native:
            return self._read_location_native(location, key, buffer)
        segs = _segments(buffer, writable=True)
        if sum(s.nbytes for s in segs) != location.length:  # a record from another layout, or a bad one
            log.warning("radixtier: record for page %s says %d bytes, the buffer has %d; treated as a miss",
                        bytes(key).hex(), location.length, sum(s.nbytes for s in segs))
            return False
        return self._read_verified([(location.slot, bytes(key), location.generation, location.length,
                                     location.checksum, segs)])[0]

    def _read_location_native(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool:
        batch = self._engine.page_batch([buffer], writable=True)
        try:
            n = batch.lengths()[0]
            if n != location.length:  # a record from another layout, or a bad one
                log.warning("radixtier: record for page %s says %d bytes, the buffer has %d; treated as a miss",
                            key.hex(), location.length, n)
                return False
            status, err = self._read_batch(
                batch, [key], [(location.slot, location.generation, location.length, location.checksum)], None)
        finally:
            batch.close()
        with self._lock:
            if status[0] == 0:
                self.counters.reads += 1
                self.counters.read_bytes += location.length
                return True
            if status[0] in (1, 4):
                self.counters.io_errors += 1
            if status[0] == 4:  # never read (the ring failed): a plain miss
                return False
            self._count_failure(status[0])
        log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                    self.path, location.slot, key.hex(), _FAILURE.get(status[0], "torn, stale or corrupt"))
        return False

    def _count_failure(self, status: int) -> None:
        """A page not proven: counted in all, and by kind (the native core's status codes)."""
        self.counters.corrupt += 1
        kind = _FAILURE_COUNTER.get(status)
        if kind is not None:
            setattr(self.counters, kind, getattr(self.counters, kind) + 1)

    def _read_verified(self, items) -> List[bool]:
        """items: (slot, key, generation, length, checksum, segments)."""
        if not items:
            return []
        headers = aligned_buffer(HEADER_BYTES * len(items))
        ops, bounces = [], []
        for j, (slot, key, gen, length, csum, sg) in enumerate(items):
            hdr = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
            payload = self._direct_segments(sg, length)
            bounce = None
            if payload is None:
                bounce = aligned_buffer(align_up(length))
                payload = [bounce]
            bounces.append(bounce)
            ops.append((slot, [hdr] + payload))
        if any(b is not None for b in bounces):
            self.counters.bounced += 1
        out = [False] * len(items)

        why = [1] * len(items)  # the native core's status codes, for the failure counters

        def verify(j: int, io_ok: bool) -> None:  # runs as each I/O lands, under the ones still in flight
            slot, key, gen, length, csum, sg = items[j]
            hdr = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
            good = io_ok and self._header_ok(hdr, slot, key, gen, length, csum)
            if io_ok and not good:
                h = SlotHeader.unpack(hdr)
                why[j] = 5 if h is not None and h.slot == slot and (h.key != key or h.generation != gen) else 2
            if good:
                src = [bounces[j][:length]] if bounces[j] is not None else sg
                good = checksum(*src) == csum
                why[j] = 3
                if good and bounces[j] is not None:
                    pos = 0
                    for s in sg:
                        s[:] = bounces[j][pos:pos + s.nbytes]
                        pos += s.nbytes
            out[j] = good

        self._run_coalesced(False, ops, verify)
        for j, good in enumerate(out):
            if good:
                self.counters.reads += 1
                self.counters.read_bytes += items[j][3]
            else:
                self._count_failure(why[j])
                log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                            self.path, items[j][0], items[j][1].hex(), _FAILURE.get(why[j], "torn or corrupt"))
        return out

    def _header_ok(self, hdr, slot: int, key: bytes, gen: int, length: int, csum: int) -> bool:
        h = SlotHeader.unpack(hdr)
        return (h is not None and h.key == key and h.generation == gen and h.length == length
                and h.checksum == csum and h.slot == slot and h.uuid == self.uuid)

    # ---------------------------------------------------------------- I/O plumbing
    def _direct_segments(self, sg: List[memoryview], length: int) -> Optional[List[memoryview]]:
        """The caller's segments themselves, when O_DIRECT can use them (aligned, whole blocks)."""
        if not self.direct:
            return list(sg) + ([memoryview(bytearray(align_up(length) - length))] if length % BLOCK else [])
        for s in sg:
            addr, n = buffer_address(s)
            if addr % BLOCK or n % BLOCK:
                return None
        return list(sg)

    def _run_coalesced(self, write: bool, ops: List[Tuple[int, List[memoryview]]],
                       on_slot_done: Optional[Callable[[int, bool], None]] = None,
                       deadline: Optional[float] = None) -> List[bool]:
        """Run per-slot I/Os, merging runs of adjacent slots into vectored I/Os of at most
        `coalesce_bytes` (big enough to cut per-I/O cost, small enough to keep the queue full)."""
        order = sorted(range(len(ops)), key=lambda j: ops[j][0])
        merged: List[Tuple[List[int], IOOp]] = []
        padded = self.sb.slot_bytes
        for j in order:
            slot, bufs = ops[j]
            nbytes = sum(b.nbytes for b in bufs)
            if merged:
                members, op = merged[-1]
                last_slot = ops[members[-1]][0]
                if (last_slot + 1 == slot and op.nbytes == len(members) * padded and nbytes == padded
                        and len(op.bufs) + len(bufs) <= IOV_MAX and op.nbytes + nbytes <= self.coalesce_bytes):
                    members.append(j)
                    op.bufs.extend(bufs)
                    continue
            merged.append(([j], IOOp(write, self._t.fd, self.sb.slot_offset(slot), list(bufs))))
        ok = [False] * len(ops)

        def done(m: int, r: int) -> None:
            members, op = merged[m]
            if r == -errno.ETIME:  # the lease's write deadline passed: not issued
                self.counters.fenced_writes += len(members)
            elif r < 0:
                self.counters.io_errors += 1
                log.error("radixtier: %s: %s of %d slot(s) failed: %s", self.path, "write" if write else "read",
                          len(members), os.strerror(-r))
            for j in members:
                ok[j] = r == op.nbytes
                if on_slot_done is not None:
                    on_slot_done(j, ok[j])

        self._engine.run([op for _, op in merged], done, deadline)
        return ok

    # ---------------------------------------------------------------- closing
    def close(self, timeout: float = 30.0) -> None:
        """Refuse new calls, wait for running ones (a transfer thread may be inside get/put), then
        release the partition (CLEAN only if nothing was left running) and close the device."""
        if self._t.fd < 0:
            return
        drained = self._gate.close(timeout)
        if not drained:
            log.error("radixtier: %s: I/O still running %.0f s after close; the partition is left marked "
                      "open (the next opener re-checks its slots) and the descriptor stays open", self.path, timeout)
            self._lease.release("keep")
            return
        try:
            self._lease.release()
        finally:
            if self._engine is not None:
                self._engine.close()
            self._t.close()

    def __enter__(self) -> "NvmeofPageStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
