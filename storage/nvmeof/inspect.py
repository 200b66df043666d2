"""Read-only report on a namespace: geometry, partition leases, slots used, and (optionally) bad pages."""

from __future__ import annotations

import os
import time
from typing import Dict, List

from radixtier.storage.nvmeof.layout import (BLOCK, ENTRY_BYTES, HEADER_BYTES, LEASE_CLEAN, LEASE_HELD, FormatError,
                                      LeaseRecord, SlotHeader, Superblock, TableEntry, align_up, checksum)
from radixtier.storage.nvmeof.target import open_target


def _lease_report(rec: LeaseRecord | None, now_ns: int) -> Dict[str, object]:
    if rec is None:
        return {"owner": None, "host": None, "pid": None, "clean": None, "held": False, "expires_in_s": None}
    held = rec.state == LEASE_HELD
    return {"owner": rec.node_id, "host": rec.host, "pid": rec.pid, "clean": rec.state == LEASE_CLEAN,
            "held": held and rec.expires_ns > now_ns,
            "expires_in_s": round((rec.expires_ns - now_ns) / 1e9, 1) if held else None}


def inspect_namespace(path: str, verify: bool = False, progress=None) -> Dict[str, object]:
    """Never writes: safe on a namespace other nodes are serving from.

    A target shorter than its superblock says (a truncated file, a resized device) is an error,
    not a report: pages in the missing part can never be read.
    """
    t = open_target(path, direct=False, readonly=True)
    try:
        head = os.pread(t.fd, BLOCK, 0)
        sb = Superblock.unpack(head.ljust(BLOCK, b"\x00"), path)
        if sb.total_bytes > t.size:
            raise FormatError(f"{path}: truncated namespace: its superblock describes {sb.total_bytes} bytes, "
                              f"the target has {t.size}; reformat it (radixtier format --force)")
        now = time.time_ns()
        table = os.pread(t.fd, sb.slot_count * ENTRY_BYTES, sb.table_offset)
        parts: List[Dict[str, object]] = []
        errors: List[Dict[str, object]] = []
        for p in range(sb.partitions):
            lease = LeaseRecord.unpack(os.pread(t.fd, BLOCK, sb.lease_offset(p)))
            rng = sb.partition_range(p)
            used = 0
            for slot in rng:
                e = TableEntry.unpack(table[slot * ENTRY_BYTES:(slot + 1) * ENTRY_BYTES])
                if e is None or e.length > sb.page_bytes:
                    continue
                used += 1
                if verify:
                    raw = os.pread(t.fd, HEADER_BYTES + align_up(e.length), sb.slot_offset(slot))
                    h = SlotHeader.unpack(raw[:HEADER_BYTES])
                    why = ""
                    if h is None:
                        why = "slot header missing or damaged"
                    elif (h.key, h.generation, h.length, h.slot, h.uuid) != (e.key, e.generation, e.length, slot, sb.uuid):
                        why = "slot header does not match its table entry (stale or torn write)"
                    elif checksum(raw[HEADER_BYTES:HEADER_BYTES + e.length]) != e.checksum:
                        why = "payload checksum mismatch"
                    if why:
                        errors.append({"partition": p, "slot": slot, "key": e.key.hex(), "error": why})
                    if progress is not None:
                        progress(1)
            parts.append({"partition": p, "slots": len(rng), "used": used, **_lease_report(lease, now)})
        return {
            "path": path, "uuid": sb.uuid, "version": sb.version, "page_bytes": sb.page_bytes,
            "slot_bytes": sb.slot_bytes, "slots": sb.slot_count, "partitions": parts,
            "used": sum(int(p["used"]) for p in parts), "bytes": sb.total_bytes, "block_device": t.is_block,
            "verified": verify, "errors": errors,
        }
    finally:
        t.close()
