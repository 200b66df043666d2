"""Page I/O: one verified batch interface to a partition's slots, over either I/O engine.

The store asks for whole batches -- "read these keys from these slots into these buffers and
prove each page", "write these pages to these slots" -- and gets per-page `PageStatus` bytes
back. Two implementations answer the same calls:
- `NativePageIO` over the io_uring engine: a batch's plan, I/O, header and CRC proof run in C
  with the GIL released (`_pagebatch.c`);
- `PythonPageIO` over any engine's `run()` (the preadv/pwritev pool): the same steps in Python,
  each page verified as its I/O lands while the rest are still in flight.
The store picks one at open (`make_page_io`) and never branches on the engine again. Page I/O
holds no store state: it reads and writes slots it is told about, and counts only `bounced`.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Set, Tuple

from radixtier.storage.api import BufferLike, buffer_address, buffer_view
from radixtier.storage.checksum import checksum
from radixtier.storage.nvmeof.io_engine import IOV_MAX, IOOp, aligned_buffer
from radixtier.storage.nvmeof.layout import (BLOCK, HEADER_BYTES, SlotHeader, Superblock, TableEntry, align_up,
                                             tag_block_hash)
from radixtier.storage.nvmeof.status import PageStatus, StoreCounters

# A page to write: (index into the batch's buffers, key, parent key or None, slot, generation, packed
# router tag or None -- layout.pack_tag)
WriteItem = Tuple[int, bytes, Optional[bytes], int, int, Optional[bytes]]
# Where a stored page is, as the slot room holds it: (slot, generation, length, checksum, ...)
SlotTuple = Tuple  # the first four fields are read; more may follow
# (status bytes, checksums, packed table entries in plan order, first errno) of a write
WriteOutcome = Tuple[bytes, List[int], bytes, int]


@dataclass(frozen=True)
class Geometry:
    """Where a namespace's slots are and how its I/O is shaped; fixed for an open store."""

    fd: int
    data_offset: int
    slot_bytes: int
    uuid: str
    uuid_bytes: bytes
    coalesce_bytes: int
    direct: bool

    @staticmethod
    def of(fd: int, sb: Superblock, coalesce_bytes: int, direct: bool) -> "Geometry":
        return Geometry(fd, sb.data_offset, sb.slot_bytes, sb.uuid, bytes.fromhex(sb.uuid), coalesce_bytes, direct)

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes


class PageBuffers(Protocol):
    """A batch's caller buffers, exported once (close() gives them back)."""

    def lengths(self) -> List[int]: ...

    def close(self) -> None: ...


class PageIO(Protocol):
    """The verified batch interface both implementations give (see module docstring)."""

    def buffers(self, buffers: Sequence[BufferLike], writable: bool) -> PageBuffers:
        """Export caller buffers once; ValueError names a bad one."""
        ...

    def read(self, bufs: PageBuffers, keys: List[bytes], slots: Sequence[SlotTuple],
             at: Optional[List[int]]) -> Tuple[bytes, int]:
        """Read keys[j] from slots[j] into buffer at[j] (or j), each proven: (status per page, first errno)."""
        ...

    def write(self, bufs: PageBuffers, plan: Sequence[WriteItem], deadline: Optional[float]) -> WriteOutcome:
        """Write plan pages with their slot headers; nothing is issued past `deadline` (errno ETIME)."""
        ...


# ---------------------------------------------------------------------------- native
class NativePageIO:
    """PageIO on the io_uring engine's native core (the engine's page_batch/read_pages/write_pages)."""

    def __init__(self, engine, geometry: Geometry) -> None:
        self._engine = engine
        self._g = geometry

    def buffers(self, buffers: Sequence[BufferLike], writable: bool) -> PageBuffers:
        return self._engine.page_batch(buffers, writable=writable)

    def read(self, bufs, keys: List[bytes], slots: Sequence[SlotTuple], at: Optional[List[int]]) -> Tuple[bytes, int]:
        g = self._g
        return self._engine.read_pages(bufs, g.fd, g.data_offset, g.slot_bytes, g.uuid_bytes, keys, slots, at,
                                       g.coalesce_bytes, g.direct)

    def write(self, bufs, plan: Sequence[WriteItem], deadline: Optional[float]) -> WriteOutcome:
        g = self._g
        return self._engine.write_pages(bufs, g.fd, g.data_offset, g.slot_bytes, g.uuid_bytes, list(plan),
                                        g.coalesce_bytes, g.direct, deadline)


# ---------------------------------------------------------------------------- Python
def header_matches(h: Optional[SlotHeader], slot: int, key: bytes, generation: int, length: int, csum: int,
                   uuid: str) -> bool:
    """A slot header proves a page only when every field names it: this slot, key, generation,
    length, checksum and namespace (the Python read path and recovery's check both ask this)."""
    return (h is not None and h.key == key and h.generation == generation and h.length == length
            and h.checksum == csum and h.slot == slot and h.uuid == uuid)


def segments(buf, writable: bool = False) -> List[memoryview]:
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


class SegmentBuffers:
    """PythonPageIO's PageBuffers: each page's segments as memoryviews."""

    def __init__(self, buffers: Sequence[BufferLike], writable: bool) -> None:
        self.segs = [segments(b, writable) for b in buffers]

    def lengths(self) -> List[int]:
        return [sum(s.nbytes for s in sg) for sg in self.segs]

    def close(self) -> None:
        self.segs = []


class PythonPageIO:
    """PageIO over any engine's run(): per-slot I/Os coalesced, each page verified as it lands."""

    def __init__(self, engine, geometry: Geometry, counters: StoreCounters) -> None:
        self._engine = engine
        self._g = geometry
        self._counters = counters

    def buffers(self, buffers: Sequence[BufferLike], writable: bool) -> SegmentBuffers:
        return SegmentBuffers(buffers, writable)

    def read(self, bufs: SegmentBuffers, keys: List[bytes], slots: Sequence[SlotTuple],
             at: Optional[List[int]]) -> Tuple[bytes, int]:
        n = len(keys)
        status = bytearray([PageStatus.IO]) * n
        if not n:
            return bytes(status), 0
        headers = aligned_buffer(HEADER_BYTES * n)
        ops, bounces = [], []
        for j in range(n):
            slot, length = slots[j][0], slots[j][2]
            sg = bufs.segs[j if at is None else at[j]]
            payload = self._direct_segments(sg, length)
            bounce = None
            if payload is None:
                bounce = aligned_buffer(align_up(length))
                payload = [bounce]
            bounces.append(bounce)
            ops.append((slot, [headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]] + payload))
        if any(b is not None for b in bounces):
            self._counters.bounced += 1

        def verify(j: int, io_ok: bool) -> None:  # runs as each I/O lands, under the ones still in flight
            slot, gen, length, csum = slots[j][0], slots[j][1], slots[j][2], slots[j][3]
            if not io_ok:
                return  # stays IO
            h = SlotHeader.unpack(headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES])
            if not header_matches(h, slot, keys[j], gen, length, csum, self._g.uuid):
                stale = h is not None and h.slot == slot and (h.key != keys[j] or h.generation != gen)
                status[j] = PageStatus.STALE if stale else PageStatus.HEADER
                return
            sg = bufs.segs[j if at is None else at[j]]
            src = [bounces[j][:length]] if bounces[j] is not None else sg
            if checksum(*src) != csum:
                status[j] = PageStatus.CHECKSUM
                return
            if bounces[j] is not None:
                pos = 0
                for s in sg:
                    s[:] = bounces[j][pos:pos + s.nbytes]
                    pos += s.nbytes
            status[j] = PageStatus.OK

        _ok, err = self._run_coalesced(False, ops, verify)
        return bytes(status), err

    def write(self, bufs: SegmentBuffers, plan: Sequence[WriteItem], deadline: Optional[float]) -> WriteOutcome:
        ops, entries, sums, bounce_bytes = [], [], [], 0
        headers = aligned_buffer(HEADER_BYTES * len(plan))
        uuid = self._g.uuid
        for j, (i, key, parent, slot, gen, tag) in enumerate(plan):
            sg = bufs.segs[i]
            length = sum(s.nbytes for s in sg)
            csum = checksum(*sg)
            hdr = headers[j * HEADER_BYTES:(j + 1) * HEADER_BYTES]
            SlotHeader(gen, length, csum, slot, key, parent, uuid).pack_into(hdr, tag)
            entries.append(TableEntry(key, parent, gen, length, csum,
                                      None if tag is None else tag_block_hash(tag)).pack())
            sums.append(csum)
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
            self._counters.bounced += 1
        try:
            ok, err = self._run_coalesced(True, ops, deadline=deadline)
        except OSError as exc:  # the io_uring engine's run(): the deadline passed before every submission
            if exc.errno != errno.ETIME:
                raise
            ok, err = [False] * len(plan), errno.ETIME  # what landed stays in free slots: no entry names it
        status = bytes(PageStatus.OK if good else PageStatus.IO for good in ok)
        return status, sums, b"".join(entries), err

    def _direct_segments(self, sg: List[memoryview], length: int) -> Optional[List[memoryview]]:
        """The caller's segments themselves, when O_DIRECT can use them (aligned, whole blocks)."""
        if not self._g.direct:
            return list(sg) + ([memoryview(bytearray(align_up(length) - length))] if length % BLOCK else [])
        for s in sg:
            addr, n = buffer_address(s)
            if addr % BLOCK or n % BLOCK:
                return None
        return list(sg)

    def _run_coalesced(self, write: bool, ops: List[Tuple[int, List[memoryview]]],
                       on_slot_done: Optional[Callable[[int, bool], None]] = None,
                       deadline: Optional[float] = None) -> Tuple[List[bool], int]:
        """Run per-slot I/Os, merging runs of adjacent slots into vectored I/Os of at most
        `coalesce_bytes` (big enough to cut per-I/O cost, small enough to keep the queue full).
        Returns (done in full, per op; the first errno seen)."""
        g = self._g
        order = sorted(range(len(ops)), key=lambda j: ops[j][0])
        merged: List[Tuple[List[int], IOOp]] = []
        for j in order:
            slot, bufs = ops[j]
            nbytes = sum(b.nbytes for b in bufs)
            if merged:
                members, op = merged[-1]
                last_slot = ops[members[-1]][0]
                if (last_slot + 1 == slot and op.nbytes == len(members) * g.slot_bytes and nbytes == g.slot_bytes
                        and len(op.bufs) + len(bufs) <= IOV_MAX and op.nbytes + nbytes <= g.coalesce_bytes):
                    members.append(j)
                    op.bufs.extend(bufs)
                    continue
            merged.append(([j], IOOp(write, g.fd, g.slot_offset(slot), list(bufs))))
        ok = [False] * len(ops)
        first_err = [0]

        def done(m: int, r: int) -> None:
            members, op = merged[m]
            if r < 0 and (not first_err[0] or r == -errno.ETIME):  # ETIME (fenced) wins: deterministic
                first_err[0] = -r
            for j in members:
                ok[j] = r == op.nbytes
                if on_slot_done is not None:
                    on_slot_done(j, ok[j])

        self._engine.run([op for _, op in merged], done, deadline)
        if not first_err[0] and not all(ok):
            first_err[0] = errno.EIO  # a short transfer
        return ok, first_err[0]


def make_page_io(engine, geometry: Geometry, counters: StoreCounters) -> PageIO:
    """The native core where the engine has it, else the Python path over the engine's run()."""
    if engine.native_pages:
        return NativePageIO(engine, geometry)
    return PythonPageIO(engine, geometry, counters)


def read_slot_headers(engine, geometry: Geometry, slots: Sequence[int], size: int) -> List[Optional[memoryview]]:
    """The first `size` bytes (a whole number of blocks) of each slot, in one parallel batch: per
    slot a view, or None where the read failed or came back short."""
    buf = aligned_buffer(size * len(slots))
    ops = [IOOp(False, geometry.fd, geometry.slot_offset(s), [buf[j * size:(j + 1) * size]])
           for j, s in enumerate(slots)]
    res = engine.run(ops) if ops else []
    return [buf[j * size:(j + 1) * size] if r >= size else None for j, r in enumerate(res)]


def verify_slots(engine, geometry: Geometry, used: List[Tuple[int, TableEntry]], full: bool,
                 page_bytes: int) -> Set[int]:
    """Slots whose header (and, if full, payload) does not match their table entry (recovery's check)."""
    bad: Set[int] = set()
    batch = 256
    size = HEADER_BYTES + (align_up(page_bytes) if full else 0)
    for i in range(0, len(used), batch):
        part = used[i:i + batch]
        views = read_slot_headers(engine, geometry, [s for s, _e in part], size)
        for (slot, e), view in zip(part, views):
            h = SlotHeader.unpack(view) if view is not None else None
            if not header_matches(h, slot, e.key, e.generation, e.length, e.checksum, geometry.uuid):
                bad.add(slot)
            elif full and checksum(view[HEADER_BYTES:HEADER_BYTES + e.length]) != e.checksum:
                bad.add(slot)
    return bad
