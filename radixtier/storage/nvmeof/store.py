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
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from radixtier.storage.api import BufferLike, LocationTuple, PageLocation, PutResult, RouterTag, TaggedPage
from radixtier.storage.nvmeof.config import DEFAULT_COALESCE_BYTES, StoreConfig
from radixtier.storage.nvmeof.gate import CallGate
from radixtier.storage.nvmeof.io_engine import deadline_check_reason, make_engine
from radixtier.storage.nvmeof.layout import ENTRY_BYTES, KEY_BYTES, pack_tag
from radixtier.storage.nvmeof.lease import PartitionLease
from radixtier.storage.nvmeof.namespace import OpenedNamespace, format_namespace, open_namespace, read_superblock
from radixtier.storage.nvmeof.page_io import Geometry, PageBuffers, make_page_io, verify_slots
from radixtier.storage.nvmeof.slots import PutPlan, SlotTable
from radixtier.storage.nvmeof.status import ALL_OK, NOT_RUN, StoreCounters, why
from radixtier.storage.nvmeof.tags import announce_order, read_tags
from radixtier.storage.nvmeof.target import read_aligned
from radixtier.validate import node_id as validate_node_id

__all__ = ["NvmeofPageStore", "StoreConfig", "StoreCounters", "format_namespace", "read_superblock",
           "DEFAULT_COALESCE_BYTES"]

log = logging.getLogger("radixtier.storage.nvmeof")


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
        self._io_geometry = geometry
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
                     partition, len(self._slots), dropped, mode)

    @property
    def fenced(self) -> str:
        """Why this store may not write its partition now ('' while it may): another opener took
        the lease (for good), or its write deadline passed without a renewal (until one succeeds).
        Reads stay verified and safe. Every write is also issued against the lease's deadline
        (checked in C right before each submission), so a pause after this check changes nothing."""
        return self._lease.lost if self._lease is not None else ""

    # ---------------------------------------------------------------- queries
    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        return self._slots.exists(_check_keys(keys))

    def leading_run(self, keys: Sequence[bytes]) -> int:
        return self._slots.leading_run(_check_keys(keys))

    def location(self, key: bytes) -> Optional[PageLocation]:
        place = self._slots.location(_check_key(key))
        return None if place is None else PageLocation(self.uuid, *place)

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]:
        uuid = self.uuid
        for key, parent, place in self._slots.entries():
            yield key, parent, PageLocation(uuid, *place)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._slots.touch(_check_keys(keys))

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None:
        """A faster tier holds these pages (or no longer does): held pages are the first victims,
        even ahead of their children, since their prefix stays reachable from that tier."""
        self._slots.hold(keys, held)

    def take_dropped(self) -> List[bytes]:
        return self._slots.take_dropped()

    def __len__(self) -> int:
        return len(self._slots)

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
            parents: Optional[Sequence[Optional[bytes]]] = None,
            tags: Optional[Sequence[Optional[RouterTag]]] = None) -> PutResult:
        """Write pages; ok[i] is True once page i is durable and indexed (or was already stored).
        The result names each stored page's location and each page evicted to make room, once.
        tags[i] (optional): what a KV-aware router calls page i -- (block hash, parent block hash or
        None, token ids) -- written with it, so `router_tags` can name it after a restart; ValueError
        for a hash outside int64. A page already stored keeps the tag it was written with."""
        with self._gate.call(self.path):
            keys = _check_keys(keys)
            if len(buffers) != len(keys):
                raise ValueError(f"put: {len(keys)} keys but {len(buffers)} buffers")
            if parents is not None and len(parents) != len(keys):
                raise ValueError(f"put: {len(keys)} keys but {len(parents)} parents")
            if tags is not None and len(tags) != len(keys):
                raise ValueError(f"put: {len(keys)} keys but {len(tags)} tags")
            parent_keys = [None] * len(keys) if parents is None else [None if p is None else _check_key(p)
                                                                      for p in parents]
            packed = None if tags is None else [None if t is None else pack_tag(t) for t in tags]
            bufs = self._io.buffers(buffers, writable=False)
            try:
                return self._put(keys, bufs, parent_keys, packed)
            finally:
                bufs.close()

    def _put(self, keys: List[bytes], bufs: PageBuffers, parent_keys: List[Optional[bytes]],
             tags: Optional[List[Optional[bytes]]]) -> PutResult:
        lengths = bufs.lengths()
        for k, n in zip(keys, lengths):
            if n > self.page_bytes or n == 0:
                raise ValueError(f"put: page {k.hex()} has {n} bytes; this namespace holds pages of "
                                 f"at most {self.page_bytes} bytes")
        if self.fenced:  # another opener holds the partition now: writing would destroy its pages
            self.counters.fenced_writes += len(keys)
            return PutResult([False] * len(keys))
        slots = self._slots
        plan = slots.plan_put(keys, parent_keys, tags)
        if plan.writes:
            try:
                self._write(bufs, lengths, plan)
            except BaseException:
                slots.abandon_put(plan)  # the rest go back free, exactly once, their in-memory entries cleared
                raise
        uuid = self.uuid
        return PutResult(plan.ok, plan.evicted, plan.already, plan.written(),
                         [None if p is None else (uuid, *p) for p in plan.places])

    def _write(self, bufs: PageBuffers, lengths: List[int], plan: PutPlan) -> None:
        """Data, then durability, then the table entries, then the in-memory index (commit_put): a
        page exists for readers (here and after a crash) only once its bytes are on the device."""
        try:
            deadline = self._lease.write_deadline()
        except OSError as exc:  # put()'s check passed but no write may be issued now: nothing of the batch is
            self._fenced_during_write(len(plan.writes), exc)
            self._slots.refuse_put(plan)
            return
        status, sums, entries, err = self._io.write(bufs, plan.writes, deadline)
        failed = len(status) - status.count(ALL_OK)
        if failed and (err == errno.ETIME or self.fenced):
            self._fenced_during_write(failed, OSError(errno.ETIME, self.fenced or "write deadline"))
        elif failed:
            self.counters.io_errors += 1
            log.error("radixtier: %s: write of %d page(s) failed: %s", self.path, failed, os.strerror(err or 5))
        if self.sync:
            os.fdatasync(self._t.fd)
        self._slots.commit_put(plan, status, sums, lengths, entries)

    def _fenced_during_write(self, pages: int, exc: OSError) -> None:
        """The lease's deadline passed (or it was lost) between put()'s check and the writes."""
        self.counters.fenced_writes += pages
        log.warning("radixtier: %s: %d page(s) not written: %s", self.path, pages, exc.strerror or exc)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._gate.call(self.path):
            return self._slots.delete(_check_keys(keys))

    def clear(self) -> int:
        return self.delete(self._slots.keys())

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
        """One verified batch read: the slot room plans it (one lock hold) and settles it (one more);
        pages are named by parallel lists, so a read allocates no object per page for a full GC
        to walk later."""
        slots = self._slots
        plan = slots.start_read(keys, bufs.lengths())  # the last step before the try that ends it
        status, err = bytes([NOT_RUN]) * len(plan.keys), 0
        try:
            if plan.keys:
                status, err = self._io.read(bufs, plan.keys, plan.slots, plan.at)
        finally:
            ok, io_failed = slots.finish_read(plan, status)
        if io_failed:
            log.error("radixtier: %s: read of %d page(s) failed: %s", self.path, io_failed, os.strerror(err or 5))
        return ok

    def read_locations(self, locations: Sequence[Union[PageLocation, LocationTuple]], keys: Sequence[bytes],
                       buffers: Sequence[BufferLike]) -> List[bool]:
        """Read pages any node wrote in this namespace, by (slot, generation), in one verified batch:
        ok[i] only for a page whose slot header and checksum prove it. A location in another
        namespace, outside this one's slots, longer than a page or not the size of its buffer is a
        miss (the last logged); nothing is freed (the slot may be another node's)."""
        with self._gate.call(self.path):
            keys = _check_keys(keys)
            if not len(locations) == len(buffers) == len(keys):
                raise ValueError(f"read_locations: {len(locations)} locations, {len(keys)} keys and "
                                 f"{len(buffers)} buffers")
            bufs = self._io.buffers(buffers, writable=True)
            try:
                lengths = bufs.lengths()
                at, places = [], []
                for i, loc in enumerate(locations):
                    ns, slot, gen, length, csum = loc if isinstance(loc, tuple) else (
                        loc.namespace, loc.slot, loc.generation, loc.length, loc.checksum)
                    if ns != self.uuid or not 0 <= slot < self.sb.slot_count or length > self.page_bytes:
                        continue
                    if lengths[i] != length:  # a record from another layout, or a bad one
                        log.warning("radixtier: record for page %s says %d bytes, the buffer has %d; treated as "
                                    "a miss", keys[i].hex(), length, lengths[i])
                        continue
                    at.append(i)
                    places.append((slot, gen, length, csum))
                ok = [False] * len(keys)
                if not at:
                    return ok
                status, _err = self._io.read(bufs, [keys[i] for i in at], places, at)
            finally:
                bufs.close()
        self._slots.count_reads(status, [p[2] for p in places])
        for j, st in enumerate(status):
            if st == ALL_OK:
                ok[at[j]] = True
            elif st != NOT_RUN:
                log.warning("radixtier: %s slot %d: page %s failed verification (%s); treated as a miss",
                            self.path, places[j][0], keys[at[j]].hex(), why(st))
        return ok

    def read_location(self, location: Union[PageLocation, LocationTuple], key: bytes, buffer: BufferLike) -> bool:
        """read_locations for one page (tools and tests; serving paths read a batch)."""
        return self.read_locations([location], [key], [buffer])[0]

    # ---------------------------------------------------------------- router tags
    def router_tags(self, batch_pages: int = 256) -> Iterator[List[TaggedPage]]:
        """What this partition holds, as a KV-aware router names it: batches of at most
        `batch_pages` pages, each (key, block hash, parent block hash or None, token ids), parents
        before children (tags.announce_order), for the pages written with a tag.

        Each page is proven before it is named (tags.read_tags: its slot header names it and holds a
        sound tag), and after its batch's header reads the partition must still hold it at that slot
        and generation: a page evicted or found damaged meanwhile is never named. The order is taken
        from a copy of the slot table made at the first batch; pages written later are not in it
        (whoever writes them announces them). Counts `tags_named` and `tags_failed`. Ends early, quietly,
        once the store closes. The slot lock is held for the table copy and one check per batch;
        no lock is held across a read or a yield."""
        if batch_pages < 1:
            raise ValueError(f"batch_pages: expected a positive integer, got {batch_pages}")
        try:
            with self._gate.call(self.path):
                table, first = self._slots.table_copy()
                order = announce_order(table, first)
        except RuntimeError:  # closed
            return
        geometry = self._io_geometry
        for i in range(0, len(order), batch_pages):
            part = order[i:i + batch_pages].tolist()
            try:
                with self._gate.call(self.path):
                    pages, places, failed = read_tags(self._engine, geometry, table, first, part)
                    held = self._slots.held_at([p[0] for p in pages], places)
            except RuntimeError:  # closed while announcing
                return
            named = [p for p, h in zip(pages, held) if h]
            self.counters.tags_named += len(named)
            self.counters.tags_failed += failed
            if named:
                yield named

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
