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

It is the thin coordinator of three rooms: the namespace is opened (superblock read once) by
namespace.py, which key is in which slot is slots.py's (`SlotTable`, with its lock), and every
page read and write goes through one verified batch interface (page_io.py, native or Python).
The store owns the partition lease, the call gate that close() waits on, the counters, and the
order of each call's steps: plan under the slot lock, I/O outside it, outcome applied under it.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import replace
from operator import itemgetter
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from radixtier.storage.api import BufferLike, PageLocation, PutResult
from radixtier.storage.nvmeof.config import DEFAULT_COALESCE_BYTES, StoreConfig
from radixtier.storage.nvmeof.gate import CallGate
from radixtier.storage.nvmeof.io_engine import deadline_check_reason, make_engine
from radixtier.storage.nvmeof.layout import ENTRY_BYTES, FREE_ENTRY, KEY_BYTES
from radixtier.storage.nvmeof.lease import PartitionLease
from radixtier.storage.nvmeof.namespace import OpenedNamespace, format_namespace, open_namespace, read_superblock
from radixtier.storage.nvmeof.page_io import Geometry, PageBuffers, make_page_io, verify_slots
from radixtier.storage.nvmeof.slots import CSUM, GEN, LENGTH, PARENT, SLOT, Slot, SlotTable
from radixtier.storage.nvmeof.status import ALL_OK, IO_FAILED, NOT_RUN, StoreCounters, why
from radixtier.storage.nvmeof.target import read_aligned
from radixtier.storage.validate import node_id as validate_node_id

__all__ = ["NvmeofPageStore", "StoreConfig", "StoreCounters", "format_namespace", "read_superblock",
           "DEFAULT_COALESCE_BYTES"]

log = logging.getLogger("radixtier.storage.nvmeof")
_LENGTH_OF = itemgetter(LENGTH)


def _check_keys(keys: Sequence[bytes]) -> List[bytes]:
    """_check_key of each key, with the common case (16 bytes already) tested first: it runs per page."""
    return [k if type(k) is bytes and len(k) == KEY_BYTES else _check_key(k) for k in keys]


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ValueError(f"key: expected {KEY_BYTES} bytes (a page hash), got {type(key).__name__} "
                         f"of length {len(key) if hasattr(key, '__len__') else '?'}")
    return bytes(key)


class NvmeofPageStore:
    """Tier-3 page store over one partition of a namespace (see module docstring).

    `path`: a block device or file, or a namespace open_namespace() already opened (the store
    takes it over). How the store runs is a `StoreConfig`; its fields may also be given as keyword
    arguments (io_engine="threads", lease_s=30, ...), which override `config`."""

    def __init__(self, path: Union[str, OpenedNamespace], page_bytes: Optional[int] = None, *, partition: int = 0,
                 node_id: str = "local", create_bytes: int = 0, partitions: int = 1,
                 config: Optional[StoreConfig] = None, **options: object) -> None:
        try:
            cfg = self._config(config, options)
            validate_node_id("node_id", node_id)
            if isinstance(path, OpenedNamespace) and page_bytes is not None and page_bytes != path.sb.page_bytes:
                raise ValueError(f"page_bytes: {path.path} holds pages of {path.sb.page_bytes} bytes, asked for "
                                 f"{page_bytes}")
        except BaseException:
            if isinstance(path, OpenedNamespace):
                path.close()  # handed over: closed here, whatever failed
            raise
        self.config = cfg
        self.node_id = node_id
        self.sync = cfg.sync
        self.coalesce_bytes = cfg.coalesce_bytes
        self.lease_s, self.lease_io_timeout_s = cfg.lease_s, cfg.lease_io_timeout_s
        ns = path if isinstance(path, OpenedNamespace) else open_namespace(
            path, page_bytes, create_bytes=create_bytes, partitions=partitions, direct=cfg.direct)
        self._t = ns.target
        self.path = ns.path
        self._gate = CallGate()
        self._lease: Optional[PartitionLease] = None
        self._engine = None
        try:
            self._open(ns, partition)
        except BaseException:
            if self._lease is not None:
                self._lease.release("restore")  # an open that failed leaves the record as it found it
            if self._engine is not None:
                self._engine.close()
            ns.close()
            raise

    @staticmethod
    def _config(config: Optional[StoreConfig], options: Dict[str, object]) -> StoreConfig:
        """`config` (or the defaults) with keyword overrides, validated; unknown options refused by name."""
        unknown = set(options) - StoreConfig.keys()
        if unknown:
            raise TypeError(f"NvmeofPageStore: unknown option {sorted(unknown)[0]!r} (options: "
                            f"{', '.join(sorted(StoreConfig.keys()))})")
        if config is None:
            return StoreConfig(**options)  # type: ignore[arg-type]
        return replace(config, **options) if options else config  # validated again, with the overrides

    # ---------------------------------------------------------------- opening and recovery
    def _open(self, ns: OpenedNamespace, partition: int) -> None:
        sb, cfg = ns.sb, self.config
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < sb.partitions:
            raise ValueError(f"partition: expected 0..{sb.partitions - 1} for {self.path}, got {partition!r}")
        self.sb = sb
        self.uuid = sb.uuid
        self.page_bytes = sb.page_bytes
        self.partition = partition
        slots = sb.partition_range(partition)
        self.capacity_pages = len(slots)
        lease = PartitionLease(self._t, sb, partition, self.node_id, lease_s=self.lease_s,
                               io_timeout_s=self.lease_io_timeout_s, force=cfg.force_takeover)
        lease.acquire()  # before anything is read or written: a held partition is refused here
        self._lease = lease
        self._engine = make_engine(cfg.io_engine, cfg.queue_depth)
        unchecked = deadline_check_reason()
        if unchecked:
            log.warning("radixtier: %s", unchecked)
        self.io_engine = self._engine.name
        self.direct = self._t.direct
        self.counters = StoreCounters()
        geometry = Geometry.of(self._t.fd, sb, cfg.coalesce_bytes, self.direct)
        self._io = make_page_io(self._engine, geometry, self.counters)
        prev = lease.previous
        if prev is not None and prev.node_id != self.node_id:
            log.warning("radixtier: %s partition %d was owned by node %r; node %r takes it over",
                        self.path, partition, prev.node_id, self.node_id)
        unclean = lease.unclean
        table_base = sb.entry_offset(slots.start)
        table = bytearray(read_aligned(self._t, table_base, len(slots) * ENTRY_BYTES))
        self._slots = SlotTable(slots, sb.page_bytes, table, table_base, cfg.eviction, self._engine, self._t.fd,
                                lease.write_deadline, cfg.sync, self.counters, self.path)
        mode = cfg.verify if cfg.verify != "auto" else ("headers" if unclean else "none")

        def check(used, full):
            return verify_slots(self._engine, geometry, used, full, sb.page_bytes)

        dropped = self._slots.recover(None if mode == "none" else check, full=(mode == "full"))
        self.recovery = {"entries": self._slots.entries_found, "dropped": dropped, "verify": mode,
                         "unclean": unclean, "lease_waited_s": round(lease.waited_s, 3)}
        if self.recovery["entries"]:
            log.info("radixtier: %s partition %d: recovered %d pages (%d dropped, verify=%s)", self.path,
                     partition, len(self._slots.index), dropped, mode)

    @property
    def fenced(self) -> str:
        """Why this store may not write its partition now ('' while it may): another opener took
        the lease (for good), or its write deadline passed without a renewal (until one succeeds).
        Reads stay verified and safe. Every write is also issued against the lease's deadline
        (checked in C right before each submission), so a pause after this check changes nothing."""
        return self._lease.lost if self._lease is not None else ""

    # ---------------------------------------------------------------- queries
    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        keys = _check_keys(keys)
        with self._slots.lock:
            index = self._slots.index
            return [k in index for k in keys]

    def leading_run(self, keys: Sequence[bytes]) -> int:
        keys = _check_keys(keys)
        with self._slots.lock:
            index = self._slots.index
            n = 0
            for k in keys:
                if k not in index:
                    break
                n += 1
            return n

    def location(self, key: bytes) -> Optional[PageLocation]:
        key = _check_key(key)
        with self._slots.lock:
            s = self._slots.index.get(key)
            return None if s is None else PageLocation(self.uuid, s[SLOT], s[GEN], s[LENGTH], s[CSUM])

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]:
        with self._slots.lock:
            items = list(self._slots.index.items())
        for key, s in items:
            yield key, s[PARENT], PageLocation(self.uuid, s[SLOT], s[GEN], s[LENGTH], s[CSUM])

    def touch(self, keys: Sequence[bytes]) -> None:
        self._slots.touch(_check_keys(keys))

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None:
        """A faster tier holds these pages (or no longer does): held pages are the first victims,
        even ahead of their children, since their prefix stays reachable from that tier."""
        self._slots.hold(keys, held)

    def take_evicted(self) -> List[bytes]:
        return self._slots.take_evicted()

    def __len__(self) -> int:
        with self._slots.lock:
            return len(self._slots.index)

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def stats(self) -> Dict[str, object]:
        return {"path": self.path, "uuid": self.uuid, "partition": self.partition, "page_bytes": self.page_bytes,
                "capacity_pages": self.capacity_pages, "used_pages": len(self), "io_engine": self.io_engine,
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
            keys = _check_keys(keys)
            if len(buffers) != len(keys):
                raise ValueError(f"put: {len(keys)} keys but {len(buffers)} buffers")
            if parents is not None and len(parents) != len(keys):
                raise ValueError(f"put: {len(keys)} keys but {len(parents)} parents")
            parent_keys = [None] * len(keys) if parents is None else [None if p is None else _check_key(p)
                                                                      for p in parents]
            bufs = self._io.buffers(buffers, writable=False)
            try:
                return self._put(keys, bufs, parent_keys)
            finally:
                bufs.close()

    def _put(self, keys: List[bytes], bufs: PageBuffers, parent_keys: List[Optional[bytes]]) -> PutResult:
        lengths = bufs.lengths()
        for k, n in zip(keys, lengths):
            if n > self.page_bytes or n == 0:
                raise ValueError(f"put: page {k.hex()} has {n} bytes; this namespace holds pages of "
                                 f"at most {self.page_bytes} bytes")
        ok = [False] * len(keys)
        evicted: List[bytes] = []
        if self.fenced:  # another opener holds the partition now: writing would destroy its pages
            self.counters.fenced_writes += len(keys)
            return PutResult(ok, evicted)
        plan: List[Tuple[int, bytes, Optional[bytes], int, int]] = []  # (i, key, parent, slot, generation)
        first_of: Dict[bytes, int] = {}  # key -> index of its first copy in this batch
        dups: List[Tuple[int, int]] = []  # (index, index of the copy that is written)
        already = 0
        slots = self._slots
        with slots.lock:
            index, order = slots.index, slots.order
            for i, key in enumerate(keys):
                if key in index:
                    ok[i] = True
                    already += 1
                    order.touch(key)
                    continue
                if key in first_of:
                    dups.append((i, first_of[key]))  # stored only if its first copy is
                    continue
                slot = slots.take_slot_locked(evicted)
                if slot is None:
                    break  # full of pages being read: the rest of this batch is not stored
                first_of[key] = i
                plan.append((i, key, parent_keys[i], slot, 0))
            if plan:
                gens = slots.generations_locked(len(plan))
                plan = [(i, key, parent, slot, gens[j]) for j, (i, key, parent, slot, _g) in enumerate(plan)]
        if plan:
            settled = bytearray(len(plan))  # 1 once page j's slot was committed or given back
            try:
                self._write(bufs, lengths, plan, ok, settled)
            except BaseException:
                with slots.lock:  # the rest go back free, exactly once, their in-memory entries cleared
                    for j, (_i, _key, _p, slot, _g) in enumerate(plan):
                        if not settled[j]:
                            slots.set_entry_locked(slot, FREE_ENTRY)
                            slots.release_locked((slot,))
                raise
        for i, j in dups:
            ok[i] = ok[j]
        return PutResult(ok, evicted, already, sum(ok[p[0]] for p in plan))

    def _write(self, bufs: PageBuffers, lengths: List[int], plan: List[Tuple[int, bytes, Optional[bytes], int, int]],
               ok: List[bool], settled: bytearray) -> None:
        """Data, then durability, then the table entries, then the in-memory index: a page exists
        for readers (here and after a crash) only once its bytes are on the device. `settled[j]` is
        set as page j's slot is committed or given back (put() gives back the rest if this raises)."""
        try:
            deadline = self._lease.write_deadline()
        except OSError as exc:
            self._refuse_planned(plan, exc, settled)
            return
        status, sums, entries, err = self._io.write(bufs, plan, deadline)
        failed = len(status) - status.count(ALL_OK)
        if failed and (err == errno.ETIME or self.fenced):
            self._fenced_during_write(failed, OSError(errno.ETIME, self.fenced or "write deadline"))
        elif failed:
            self.counters.io_errors += 1
            log.error("radixtier: %s: write of %d page(s) failed: %s", self.path, failed, os.strerror(err or 5))
        if self.sync:
            os.fdatasync(self._t.fd)
        placed = [(slot, gen, lengths[i], sums[j], parent) for j, (i, _key, parent, slot, gen) in enumerate(plan)]
        self._commit_written(plan, entries, placed, status, ok, settled)

    def _commit_written(self, plan: list, entries: bytes, placed: List[Slot], status: bytes,
                        ok: List[bool], settled: bytearray) -> None:
        """Written pages become visible: table entries, made durable, then the in-memory index.
        `entries` holds each planned page's packed table entry (ENTRY_BYTES apiece, plan order) and
        `placed` its index tuple: a batch is committed without building an object per page."""
        entry = memoryview(entries)
        slots = self._slots
        with slots.lock:
            for j, (_i, _key, _parent, slot, _g) in enumerate(plan):
                slots.set_entry_locked(slot, entry[j * ENTRY_BYTES:(j + 1) * ENTRY_BYTES]
                                       if status[j] == ALL_OK else FREE_ENTRY)
        try:
            slots.flush(slots.entry_block(slot) for _i, _k, _p, slot, _g in plan)
            table_ok = True
        except OSError as exc:
            log.error("radixtier: %s", exc)
            table_ok = False
        pages = nbytes = 0
        with slots.lock:
            for j, (i, key, _parent, slot, _g) in enumerate(plan):
                if status[j] == ALL_OK and table_ok:
                    slots.commit_locked(key, placed[j])
                    ok[i] = True
                    pages += 1
                    nbytes += placed[j][LENGTH]
                else:
                    if not table_ok:  # else a later flush of this block would write the entry out
                        slots.set_entry_locked(slot, FREE_ENTRY)
                    slots.release_locked((slot,))
                settled[j] = 1
            self.counters.writes += pages
            self.counters.write_bytes += nbytes

    def _refuse_planned(self, plan: list, exc: OSError, settled: bytearray) -> None:
        """put()'s check passed but no write may be issued now (the lease's deadline passed, or it
        was lost): nothing of the batch is written. Its slots go back free with their in-memory
        entries cleared (an evicted victim's included), so no later flush writes a stale entry."""
        self._fenced_during_write(len(plan), exc)
        slots = self._slots
        with slots.lock:
            for _i, _key, _parent, slot, _g in plan:
                slots.set_entry_locked(slot, FREE_ENTRY)
            slots.release_locked(slot for _i, _key, _parent, slot, _g in plan)
            settled[:] = b"\x01" * len(plan)

    def _fenced_during_write(self, pages: int, exc: OSError) -> None:
        """The lease's deadline passed (or it was lost) between put()'s check and the writes."""
        self.counters.fenced_writes += pages
        log.warning("radixtier: %s: %d page(s) not written: %s", self.path, pages, exc.strerror or exc)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._gate.call(self.path):
            keys = _check_keys(keys)
            blocks: List[int] = []
            slots = self._slots
            with slots.lock:
                for k in keys:
                    slots.remove_locked(k, blocks)
            slots.flush_logged(blocks)
            return len(blocks)

    def clear(self) -> int:
        with self._slots.lock:
            keys = list(self._slots.index)
        return self.delete(keys)

    # ---------------------------------------------------------------- reads
    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        """Read pages into caller buffers; ok[i] is True only for a page proven intact."""
        with self._gate.call(self.path):
            keys = _check_keys(keys)
            if len(buffers) != len(keys):
                raise ValueError(f"get: {len(keys)} keys but {len(buffers)} buffers")
            bufs = self._io.buffers(buffers, writable=True)
            try:
                return self._get(keys, bufs)
            finally:
                bufs.close()

    def _get(self, keys: List[bytes], bufs: PageBuffers) -> List[bool]:
        """One verified batch read; Python does only the index, and names the pages by parallel
        lists (no object per page for a full GC to walk later)."""
        lengths = bufs.lengths()
        slots = self._slots
        with slots.lock:
            found = list(map(slots.index.get, keys))
            if None in found:  # read only the pages here: `held` indexes them into keys and buffers
                held: Optional[List[int]] = [i for i, s in enumerate(found) if s is not None]
                keys, found, asked = [keys[i] for i in held], [found[i] for i in held], [lengths[i] for i in held]
            else:  # the usual case, every page here: no Python step per page
                held, asked = None, lengths
            stored = list(map(_LENGTH_OF, found))
            if stored != asked:  # every size checked before any page is pinned
                j = next(j for j, (a, b) in enumerate(zip(asked, stored)) if a != b)
                raise ValueError(f"get: buffer for page {keys[j].hex()} has {asked[j]} bytes, the stored "
                                 f"page has {stored[j]}")
            self.counters.misses += len(lengths) - len(keys)
            reading = slots.begin_read_locked(keys)  # the last step before the try that ends it
        status, err = bytes([NOT_RUN]) * len(keys), 0
        try:
            if keys:
                status, err = self._io.read(bufs, keys, found, held)
        finally:
            slots.end_read(reading)
        ok = [False] * len(lengths)
        if status.count(ALL_OK) == len(keys):  # the usual case: every page proven
            if held is None:
                ok = [True] * len(lengths)
            else:
                for i in held:
                    ok[i] = True
            with slots.lock:
                self.counters.reads += len(keys)
                self.counters.read_bytes += sum(stored)
            return ok
        at = range(len(keys)) if held is None else held  # page j of the read is page at[j] of the call
        bad, good_bytes = [], 0
        for j, st in enumerate(status):
            if st == ALL_OK:
                ok[at[j]] = True
                good_bytes += stored[j]
            elif st != NOT_RUN:  # never read (the ring failed): a plain miss, the page stays
                bad.append(j)
        io_failed = sum(1 for st in status if st in IO_FAILED)
        with slots.lock:
            self.counters.reads += sum(ok)
            self.counters.read_bytes += good_bytes
            if io_failed:
                self.counters.io_errors += 1
        if io_failed:
            log.error("radixtier: %s: read of %d page(s) failed: %s", self.path, io_failed, os.strerror(err or 5))
        self._drop_unproven([(keys[j], found[j], status[j]) for j in bad])
        return ok

    def _drop_unproven(self, failed: List[Tuple[bytes, Slot, int]]) -> None:
        """Pages a read could not prove: counted, logged, and their slots freed (never read again)."""
        blocks: List[int] = []
        slots = self._slots
        with slots.lock:
            for key, s, st in failed:
                self.counters.count_unproven(st)
                log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                            self.path, s[SLOT], key.hex(), why(st))
                slots.free_unproven_locked(key, s, blocks)
        if blocks:
            slots.flush_logged(blocks)

    def read_location(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool:
        """Read a page any node wrote in this namespace, by (slot, generation), verified."""
        with self._gate.call(self.path):
            if location.namespace != self.uuid or not 0 <= location.slot < self.sb.slot_count:
                return False
            if location.length > self.page_bytes:
                return False
            key = _check_key(key)
            bufs = self._io.buffers([buffer], writable=True)
            try:
                n = bufs.lengths()[0]
                if n != location.length:  # a record from another layout, or a bad one
                    log.warning("radixtier: record for page %s says %d bytes, the buffer has %d; treated as a miss",
                                key.hex(), location.length, n)
                    return False
                status, err = self._io.read(
                    bufs, [key], [(location.slot, location.generation, location.length, location.checksum)], None)
            finally:
                bufs.close()
        st = status[0]
        with self._slots.lock:
            if st == ALL_OK:
                self.counters.reads += 1
                self.counters.read_bytes += location.length
                return True
            if st in IO_FAILED:
                self.counters.io_errors += 1
            if st == NOT_RUN:  # never read (the ring failed): a plain miss
                return False
            self.counters.count_unproven(st)
        log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                    self.path, location.slot, key.hex(), why(st))
        return False

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
