"""Read-only report on a namespace: geometry, partition leases, slots used, and (optionally) bad pages.

A superblock is trusted for nothing it could make expensive: the slot table and every page are
read in chunks of at most READ_CHUNK_BYTES, so a crafted superblock claiming 2**27 slots (an 8 GiB
table) or a table entry claiming a 1 GiB page costs time in proportion to the target, never memory.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import crc32c as _crc32c

from radixtier.storage.nvmeof.layout import (BLOCK, ENTRY_BYTES, HEADER_BYTES, LEASE_CLEAN, LEASE_HELD, FormatError,
                                      LeaseRecord, SlotHeader, Superblock, TableEntry, unpack_tag)
from radixtier.storage.nvmeof.target import Target, open_target

READ_CHUNK_BYTES = 4 << 20  # the most inspect holds of the table or of a page at once (a multiple of ENTRY_BYTES)


def _lease_report(rec: LeaseRecord | None, now_ns: int) -> Dict[str, object]:
    if rec is None:
        return {"owner": None, "host": None, "pid": None, "clean": None, "held": False, "expires_in_s": None}
    held = rec.state == LEASE_HELD
    return {"owner": rec.node_id, "host": rec.host, "pid": rec.pid, "clean": rec.state == LEASE_CLEAN,
            "held": held and rec.expires_ns > now_ns,
            "expires_in_s": round((rec.expires_ns - now_ns) / 1e9, 1) if held else None}


def _check_fits(sb: Superblock, t: Target, path: str) -> None:
    """Refuse a geometry the target cannot hold (a truncated file, a resized device, a crafted
    superblock): pages in the missing part could never be read, and nothing the superblock claims
    is read before this check."""
    if sb.total_bytes > t.size:
        raise FormatError(f"{path}: truncated namespace: its superblock claims slots={sb.slot_count} of "
                          f"{sb.slot_bytes} bytes ({sb.total_bytes} bytes in all), the target has {t.size}; "
                          f"reformat it (radixtier format --force)")


def _next_data(fd: int, offset: int) -> Optional[int]:
    """Where the target's data starts at or after `offset` (None: only a hole is left), so the
    never-written table of a sparse file namespace (how `radixtier format` makes one) is skipped
    without reading gigabytes of zeros; a target that cannot say (a device, some filesystems) is
    all data."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        return None if exc.errno == errno.ENXIO else offset


def _table_chunks(fd: int, sb: Superblock, slots: range, path: str) -> Iterator[Tuple[int, bytes]]:
    """(first slot, its entries' bytes) for each chunk of `slots` that holds anything: the table is
    read READ_CHUNK_BYTES at a time into one reused buffer (a fresh buffer per chunk costs a page
    fault per 4 KiB), a chunk lying in a hole is not read at all, and a chunk of free, all-zero
    entries is skipped with one comparison instead of decoding each entry."""
    per_chunk = READ_CHUNK_BYTES // ENTRY_BYTES
    size = min(per_chunk, len(slots)) * ENTRY_BYTES
    buf = bytearray(size)
    view = memoryview(buf)
    zero = bytes(size)
    for first in range(slots.start, slots.stop, per_chunk):
        want = min(per_chunk, slots.stop - first) * ENTRY_BYTES
        data = _next_data(fd, sb.entry_offset(first))
        if data is None:
            return
        if data >= sb.entry_offset(first) + want:
            continue
        got = os.preadv(fd, [view[:want]], sb.entry_offset(first))
        if got != want:  # the target shrank under us: _check_fits passed when it was opened
            raise FormatError(f"{path}: slot table cut short at slot {first + got // ENTRY_BYTES} "
                              f"(the target is smaller than its superblock says)")
        raw = buf if want == size else view[:want].tobytes()  # the last chunk can be shorter
        if raw != zero[:want]:  # zero[:size] is zero itself, not a copy
            yield first, bytes(raw)


def _used_entries(fd: int, sb: Superblock, slots: range, path: str) -> Iterator[Tuple[int, TableEntry]]:
    """(slot, entry) for each used entry in `slots` (a damaged entry, or one claiming more than a
    page, counts as free, as the store itself treats it)."""
    for first, raw in _table_chunks(fd, sb, slots, path):
        for i in range(len(raw) // ENTRY_BYTES):
            e = TableEntry.unpack(raw[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES])
            if e is not None and e.length <= sb.page_bytes:
                yield first + i, e


def _payload_checksum(fd: int, offset: int, length: int) -> Optional[int]:
    """CRC-32C of `length` bytes at `offset`, READ_CHUNK_BYTES at a time (a page can be as large as
    the superblock says); None if the target ends first."""
    crc = 0
    done = 0
    while done < length:
        raw = os.pread(fd, min(READ_CHUNK_BYTES, length - done), offset + done)
        if not raw:
            return None
        crc = _crc32c.crc32c(raw, value=crc)
        done += len(raw)
    return crc & 0xFFFFFFFF


def _slot_error(fd: int, sb: Superblock, slot: int, e: TableEntry) -> str:
    """Why the page in `slot` is not the one its table entry names ('' if it is)."""
    raw = os.pread(fd, HEADER_BYTES, sb.slot_offset(slot)).ljust(HEADER_BYTES, b"\x00")
    h = SlotHeader.unpack(raw)
    if h is None:
        return "slot header missing or damaged"
    if (h.key, h.generation, h.length, h.slot, h.uuid) != (e.key, e.generation, e.length, slot, sb.uuid):
        return "slot header does not match its table entry (stale or torn write)"
    if e.block_hash is not None:
        tag = unpack_tag(raw)
        if tag is None or tag[0] != e.block_hash:
            return "router tag damaged or not the one its table entry names"
    if _payload_checksum(fd, sb.slot_offset(slot) + HEADER_BYTES, e.length) != e.checksum:
        return "payload checksum mismatch"
    return ""


def _partition_report(fd: int, sb: Superblock, p: int, path: str, verify: bool, now_ns: int,
                      errors: List[Dict[str, object]], progress: Optional[Callable[[int], object]]
                      ) -> Dict[str, object]:
    """One partition's line of the report; its bad pages (with --verify) are appended to `errors`."""
    lease = LeaseRecord.unpack(os.pread(fd, BLOCK, sb.lease_offset(p)))
    rng = sb.partition_range(p)
    used = tagged = 0
    for slot, e in _used_entries(fd, sb, rng, path):
        used += 1
        tagged += e.block_hash is not None
        if not verify:
            continue
        why = _slot_error(fd, sb, slot, e)
        if why:
            errors.append({"partition": p, "slot": slot, "key": e.key.hex(), "error": why})
        if progress is not None:
            progress(1)
    return {"partition": p, "slots": len(rng), "used": used, "tagged": tagged, **_lease_report(lease, now_ns)}


def inspect_namespace(path: str, verify: bool = False, progress=None) -> Dict[str, object]:
    """Never writes: safe on a namespace other nodes are serving from.

    A target shorter than its superblock says (a truncated file, a resized device) is an error,
    not a report: pages in the missing part can never be read.
    """
    t = open_target(path, direct=False, readonly=True)
    try:
        head = os.pread(t.fd, BLOCK, 0)
        sb = Superblock.unpack(head.ljust(BLOCK, b"\x00"), path)
        _check_fits(sb, t, path)
        now = time.time_ns()
        errors: List[Dict[str, object]] = []
        parts = [_partition_report(t.fd, sb, p, path, verify, now, errors, progress) for p in range(sb.partitions)]
        return {
            "path": path, "uuid": sb.uuid, "version": sb.version, "page_bytes": sb.page_bytes,
            "slot_bytes": sb.slot_bytes, "slots": sb.slot_count, "partitions": parts,
            "used": sum(int(p["used"]) for p in parts), "bytes": sb.total_bytes, "block_device": t.is_block,
            "verified": verify, "errors": errors,
        }
    finally:
        t.close()
