"""On-device format of a radixtier namespace: superblock, owner table, slot table, page slots.

    block 0         superblock (magic, version, uuid, page bytes, slot geometry, crc)
    block 1         owner table: one 64-byte record per partition (node id, clean flag)
    table_offset    slot table: one 64-byte entry per slot (key, parent, generation, checksum, crc)
    data_offset     slots: [4 KiB header | payload padded to 4 KiB], slot_bytes apart

A put writes the slot (header + payload) first, then its table entry: the table is the
key->slot index that survives restart, and an entry never names a slot whose write did not
finish. The slot header repeats key, generation, length and checksum so any reader, on any
node, can prove a slot holds the page it asked for. Every record carries its own CRC-32C, and
64-byte table entries never straddle a 512-byte sector, so a torn table write damages at
most the one entry being changed.
"""

from __future__ import annotations

import struct
import uuid as uuid_mod

import crc32c as _crc32c
from dataclasses import dataclass
from typing import Optional

BLOCK = 4096
SUPERBLOCK_MAGIC = b"RDXTIER\x01"
FORMAT_VERSION = 1
HEADER_BYTES = BLOCK
ENTRY_BYTES = 64
ENTRIES_PER_BLOCK = BLOCK // ENTRY_BYTES
OWNER_BYTES = 64
MAX_PARTITIONS = BLOCK // OWNER_BYTES
KEY_BYTES = 16

_SB = struct.Struct("<8sII16sQQQIQQQ")  # magic, version, flags, uuid, page, slot, slots, parts, table, data, created
_SB_CRC = struct.Struct("<I")
_ENTRY = struct.Struct("<HBBIQ16s16sI8s")  # magic, state, flags, length, generation, key, parent, checksum, reserved
_ENTRY_MAGIC = 0x5452
_HDR = struct.Struct("<4sHHQIIQ16s16s16s")  # magic, version, flags, generation, length, checksum, slot, key, parent, uuid
_HDR_MAGIC = b"RTPG"
_OWNER = struct.Struct("<48sBBHQ")  # node id, state, flags, reserved, opened_at_ns
_NO_PARENT = b"\x00" * KEY_BYTES

STATE_FREE = 0
STATE_USED = 1
OWNER_CLEAN = 1
OWNER_DIRTY = 2


class FormatError(ValueError):
    """The target is not a radixtier namespace, or not the one the caller asked for."""


def align_up(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


def checksum(*chunks) -> int:
    """CRC-32C (Castagnoli, hardware-accelerated, GIL released on large buffers) over the chunks."""
    crc = 0
    for c in chunks:
        crc = _crc32c.crc32c(c, value=crc)
    return crc & 0xFFFFFFFF


@dataclass(frozen=True)
class Superblock:
    uuid: str
    page_bytes: int
    slot_bytes: int
    slot_count: int
    partitions: int
    table_offset: int
    data_offset: int
    created_ns: int = 0
    version: int = FORMAT_VERSION

    @staticmethod
    def plan(page_bytes: int, total_bytes: int, partitions: int, created_ns: int,
             ns_uuid: Optional[str] = None) -> "Superblock":
        """Largest slot count that fits in total_bytes, each partition a whole number of table blocks."""
        if page_bytes <= 0:
            raise ValueError(f"page_bytes: expected a positive integer, got {page_bytes}")
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions: expected 1..{MAX_PARTITIONS}, got {partitions}")
        slot_bytes = HEADER_BYTES + align_up(page_bytes)
        table_offset = 2 * BLOCK
        per_slot = slot_bytes + ENTRY_BYTES
        raw = max(0, (total_bytes - table_offset - BLOCK) // per_slot)
        unit = ENTRIES_PER_BLOCK * partitions
        slots = raw // unit * unit
        if slots == 0:
            need = table_offset + unit * per_slot + BLOCK
            raise ValueError(f"capacity: {total_bytes} bytes hold no slot of {slot_bytes} bytes for {partitions} "
                             f"partition(s); need at least {need} bytes")
        data_offset = align_up(table_offset + slots * ENTRY_BYTES)
        while data_offset + slots * slot_bytes > total_bytes:
            slots -= unit
            data_offset = align_up(table_offset + slots * ENTRY_BYTES)
        return Superblock(ns_uuid or uuid_mod.uuid4().hex, page_bytes, slot_bytes, slots, partitions,
                          table_offset, data_offset, created_ns)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.slot_count * self.slot_bytes

    def partition_range(self, partition: int) -> range:
        per = self.slot_count // self.partitions
        return range(partition * per, (partition + 1) * per)

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def entry_offset(self, slot: int) -> int:
        return self.table_offset + slot * ENTRY_BYTES

    def pack(self) -> bytes:
        body = _SB.pack(SUPERBLOCK_MAGIC, self.version, 0, bytes.fromhex(self.uuid), self.page_bytes,
                        self.slot_bytes, self.slot_count, self.partitions, self.table_offset,
                        self.data_offset, self.created_ns)
        return (body + _SB_CRC.pack(checksum(body))).ljust(BLOCK, b"\x00")

    @staticmethod
    def unpack(block: bytes, where: str) -> "Superblock":
        body = block[:_SB.size]
        if body[:8] != SUPERBLOCK_MAGIC:
            raise FormatError(f"{where}: not a radixtier namespace (no superblock); format it with "
                              f"`radixtier format {where} --page-bytes N`")
        (crc,) = _SB_CRC.unpack_from(block, _SB.size)
        if crc != checksum(body):
            raise FormatError(f"{where}: superblock checksum mismatch (damaged superblock)")
        magic, version, _flags, raw_uuid, page, slot, slots, parts, table, data, created = _SB.unpack(body)
        if version != FORMAT_VERSION:
            raise FormatError(f"{where}: format version {version}, this radixtier reads version {FORMAT_VERSION}")
        return Superblock(raw_uuid.hex(), page, slot, slots, parts, table, data, created, version)


@dataclass(frozen=True)
class TableEntry:
    key: bytes
    parent: Optional[bytes]
    generation: int
    length: int
    checksum: int

    def pack(self) -> bytes:
        body = _ENTRY.pack(_ENTRY_MAGIC, STATE_USED, 0, self.length, self.generation, self.key,
                           self.parent or _NO_PARENT, self.checksum, b"\x00" * 8)
        return body + _SB_CRC.pack(checksum(body))

    @staticmethod
    def unpack(raw: bytes) -> Optional["TableEntry"]:
        """The entry, or None for a free, never-written or damaged entry."""
        body = raw[:_ENTRY.size]
        magic, state, _flags, length, gen, key, parent, csum, _res = _ENTRY.unpack(body)
        if magic != _ENTRY_MAGIC or state != STATE_USED:
            return None
        (crc,) = _SB_CRC.unpack_from(raw, _ENTRY.size)
        if crc != checksum(body):
            return None
        return TableEntry(key, None if parent == _NO_PARENT else parent, gen, length, csum)


FREE_ENTRY = b"\x00" * ENTRY_BYTES


@dataclass(frozen=True)
class SlotHeader:
    generation: int
    length: int
    checksum: int
    slot: int
    key: bytes
    parent: Optional[bytes]
    uuid: str

    def pack_into(self, buf: memoryview) -> None:
        body = _HDR.pack(_HDR_MAGIC, FORMAT_VERSION, 0, self.generation, self.length, self.checksum,
                         self.slot, self.key, self.parent or _NO_PARENT, bytes.fromhex(self.uuid))
        buf[:len(body)] = body
        buf[len(body):len(body) + 4] = _SB_CRC.pack(checksum(body))

    @staticmethod
    def unpack(buf) -> Optional["SlotHeader"]:
        body = bytes(buf[:_HDR.size])
        magic, version, _flags, gen, length, csum, slot, key, parent, raw_uuid = _HDR.unpack(body)
        if magic != _HDR_MAGIC or version != FORMAT_VERSION:
            return None
        (crc,) = _SB_CRC.unpack_from(bytes(buf[_HDR.size:_HDR.size + 4]))
        if crc != checksum(body):
            return None
        return SlotHeader(gen, length, csum, slot, key, None if parent == _NO_PARENT else parent, raw_uuid.hex())


@dataclass(frozen=True)
class OwnerRecord:
    node_id: str
    state: int
    opened_ns: int

    def pack(self) -> bytes:
        return _OWNER.pack(self.node_id.encode()[:48], self.state, 0, 0, self.opened_ns).ljust(OWNER_BYTES, b"\x00")

    @staticmethod
    def unpack(raw: bytes) -> Optional["OwnerRecord"]:
        node, state, _f, _r, opened = _OWNER.unpack(raw[:_OWNER.size])
        if state not in (OWNER_CLEAN, OWNER_DIRTY):
            return None
        return OwnerRecord(node.rstrip(b"\x00").decode(errors="replace"), state, opened)
