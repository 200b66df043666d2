"""Read-only report on a namespace: geometry, owners, slots used, and (optionally) bad pages."""

from __future__ import annotations

import os
from typing import Dict, List

from radixtier.storage.layout import (BLOCK, ENTRY_BYTES, HEADER_BYTES, OWNER_BYTES, OwnerRecord, SlotHeader,
                                      Superblock, TableEntry, align_up, checksum)
from radixtier.storage.target import open_target


def inspect_namespace(path: str, verify: bool = False, progress=None) -> Dict[str, object]:
    """Never writes: safe on a namespace other nodes are serving from."""
    t = open_target(path, direct=False, readonly=True)
    try:
        sb = Superblock.unpack(os.pread(t.fd, BLOCK, 0), path)
        owners_raw = os.pread(t.fd, BLOCK, BLOCK)
        table = os.pread(t.fd, sb.slot_count * ENTRY_BYTES, sb.table_offset)
        parts: List[Dict[str, object]] = []
        errors: List[Dict[str, object]] = []
        for p in range(sb.partitions):
            owner = OwnerRecord.unpack(owners_raw[p * OWNER_BYTES:(p + 1) * OWNER_BYTES])
            rng = sb.partition_range(p)
            used = 0
            for slot in rng:
                e = TableEntry.unpack(table[slot * ENTRY_BYTES:(slot + 1) * ENTRY_BYTES])
                if e is None:
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
            parts.append({"partition": p, "slots": len(rng), "used": used,
                          "owner": owner.node_id if owner else None,
                          "clean": (owner.state == 1) if owner else None})
        return {
            "path": path, "uuid": sb.uuid, "version": sb.version, "page_bytes": sb.page_bytes,
            "slot_bytes": sb.slot_bytes, "slots": sb.slot_count, "partitions": parts,
            "used": sum(int(p["used"]) for p in parts), "bytes": sb.total_bytes, "block_device": t.is_block,
            "verified": verify, "errors": errors,
        }
    finally:
        t.close()
