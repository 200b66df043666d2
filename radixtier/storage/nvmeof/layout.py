"""On-device format of a radixtier namespace: superblock, partition leases, slot table, page slots.

    block 0         superblock (magic, version, uuid, page bytes, slot geometry, crc)
    blocks 1..P     one lease block per partition (holder, heartbeat, expiry, clean flag)
    table_offset    slot table: one 64-byte entry per slot (key, parent, generation, checksum, crc)
    data_offset     slots: [4 KiB header | payload padded to 4 KiB], slot_bytes apart

A put writes the slot (header + payload) first, then its table entry: the table is the
key->slot index that survives restart, and an entry never names a slot whose write did not
finish. The slot header repeats key, generation, length and checksum so any reader, on any
node, can prove a slot holds the page it asked for. Every record carries its own CRC-32C, and
64-byte table entries never straddle a 512-byte sector, so a torn table write damages at
most the one entry being changed.

Each partition's lease has a block of its own, so opening, renewing or closing one partition
never reads-modifies-writes another's (version 1 kept all owner flags in one shared block).

A page may carry its **router tag** -- what a KV-aware router's `BlockStored` names it by: the
engine's block hash, its parent's, and the page's token ids -- so a restarted node can announce
what its partition holds. The tag sits in the slot header's spare bytes (`EVENT_OFFSET` on, its
own CRC), written in the same I/O as the page, and the block hash is repeated in the table
entry's spare bytes (flag `ENTRY_TAGGED`): a tag exists for a reader only where its page landed.
Both live in bytes version 2 left zero and never read, so this is still format version 2: a
namespace written before tags reads as one whose pages carry none, and an older radixtier reads a
tagged namespace unchanged.
"""

from __future__ import annotations

import struct
import uuid as uuid_mod

from radixtier.storage.api import KEY_BYTES, RouterTag
from radixtier.storage.checksum import checksum
from dataclasses import dataclass
from typing import List, Optional, Tuple

BLOCK = 4096
SUPERBLOCK_MAGIC = b"RDXTIER\x01"
FORMAT_VERSION = 2
HEADER_BYTES = BLOCK
ENTRY_BYTES = 64
ENTRIES_PER_BLOCK = BLOCK // ENTRY_BYTES
MAX_PARTITIONS = 64

_SB = struct.Struct("<8sII16sQQQIQQQ")  # magic, version, flags, uuid, page, slot, slots, parts, table, data, created
_SB_CRC = struct.Struct("<I")
_ENTRY = struct.Struct("<HBBIQ16s16sI8s")  # magic, state, flags, length, generation, key, parent, checksum, reserved
_ENTRY_MAGIC = 0x5452
_HDR = struct.Struct("<4sHHQIIQ16s16s16s")  # magic, version, flags, generation, length, checksum, slot, key, parent, uuid
_HDR_MAGIC = b"RTPG"
# magic, version, state, flags, node id, host, boot id, pid namespace, pid, pid start ticks, token,
# acquired, renewed, expires
_LEASE = struct.Struct("<4sHBB48s64s16sQIQ16sQQQ")
_LEASE_MAGIC = b"RTLS"
_NO_PARENT = b"\x00" * KEY_BYTES
# A page's router tag, at EVENT_OFFSET in its slot header: magic, version, flags, block hash, parent
# block hash, token count; then the token ids (int32 each) and a CRC-32C of everything before it.
_TAG = struct.Struct("<4sHHqqI")
_TAG_MAGIC = b"RTEV"
_TAG_VERSION = 1
_TAG_HAS_PARENT = 1
_TOKEN = struct.Struct("<i")
EVENT_OFFSET = 128
MAX_TAG_TOKENS = (BLOCK - EVENT_OFFSET - _TAG.size - 4) // _TOKEN.size
ENTRY_TAGGED = 1  # table entry flag: its spare bytes hold the page's block hash (its header holds the tag)

STATE_FREE = 0
STATE_USED = 1
LEASE_CLEAN = 1  # released by a clean close: the table needs no re-check
LEASE_HELD = 2  # open (or its holder crashed): recovery re-checks slot headers
# What the native page core (_pagebatch.c) must have been compiled with: it exports its #defines
# as _uring.LAYOUT, and the io_uring engine refuses a build whose values differ from these.
NATIVE_LAYOUT = {"BLOCK": BLOCK, "HEADER_BODY": _HDR.size, "FORMAT_VERSION": FORMAT_VERSION, "KEY_BYTES": KEY_BYTES,
                 "ENTRY_BYTES": ENTRY_BYTES, "ENTRY_BODY": _ENTRY.size, "ENTRY_MAGIC": _ENTRY_MAGIC,
                 "STATE_USED": STATE_USED, "EVENT_OFFSET": EVENT_OFFSET, "ENTRY_TAGGED": ENTRY_TAGGED}


class FormatError(ValueError):
    """The target is not a radixtier namespace, or not the one the caller asked for."""


def align_up(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


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
        if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions: expected 1..{MAX_PARTITIONS}, got {partitions}")
        slot_bytes = HEADER_BYTES + align_up(page_bytes)
        table_offset = (1 + partitions) * BLOCK  # superblock, then one lease block per partition
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

    def lease_offset(self, partition: int) -> int:
        return (1 + partition) * BLOCK

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
        sb = Superblock(raw_uuid.hex(), page, slot, slots, parts, table, data, created, version)
        why = sb._geometry_error()
        if why:
            raise FormatError(f"{where}: superblock geometry is inconsistent ({why})")
        return sb

    def _geometry_error(self) -> str:
        """What is impossible about this geometry ('' if nothing): a CRC-valid superblock can still
        have been written by a buggy or hostile tool, and every offset below is trusted later."""
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            return f"partitions={self.partitions}"
        if self.page_bytes <= 0 or self.slot_bytes != HEADER_BYTES + align_up(self.page_bytes):
            return f"page_bytes={self.page_bytes}, slot_bytes={self.slot_bytes}"
        if self.slot_count <= 0 or self.slot_count % (ENTRIES_PER_BLOCK * self.partitions):
            return f"slots={self.slot_count} for {self.partitions} partition(s)"
        if self.table_offset != (1 + self.partitions) * BLOCK:
            return f"table_offset={self.table_offset}"
        if self.data_offset != align_up(self.table_offset + self.slot_count * ENTRY_BYTES):
            return f"data_offset={self.data_offset}"
        return ""




def pack_tag(tag: RouterTag) -> bytes:
    """A page's router tag as the slot header holds it (at EVENT_OFFSET). Token ids past
    MAX_TAG_TOKENS, or outside int32, leave the tag without tokens (its hashes still name it).
    ValueError for a hash outside int64."""
    block_hash, parent, tokens = tag
    try:
        ids = struct.pack(f"<{len(tokens)}i", *tokens) if 0 < len(tokens) <= MAX_TAG_TOKENS else b""
    except struct.error:
        ids = b""
    try:
        body = _TAG.pack(_TAG_MAGIC, _TAG_VERSION, 0 if parent is None else _TAG_HAS_PARENT, block_hash,
                         parent or 0, len(ids) // _TOKEN.size) + ids
    except struct.error:
        raise ValueError(f"router tag: block hashes must be int64, got {block_hash!r}, {parent!r}") from None
    return body + _SB_CRC.pack(checksum(body))


def unpack_tag(header: bytes) -> Optional[Tuple[int, Optional[int], List[int]]]:
    """The router tag in a slot header block (block hash, parent or None, token ids), or None when
    the header carries none or a damaged one."""
    end = EVENT_OFFSET + _TAG.size
    if len(header) < end + 4 or header[EVENT_OFFSET:EVENT_OFFSET + 4] != _TAG_MAGIC:
        return None
    _m, version, flags, block_hash, parent, n = _TAG.unpack_from(header, EVENT_OFFSET)
    if version != _TAG_VERSION or n > MAX_TAG_TOKENS:
        return None
    stop = end + n * _TOKEN.size
    (crc,) = _SB_CRC.unpack_from(header, stop)
    if crc != checksum(bytes(header[EVENT_OFFSET:stop])):
        return None
    tokens = list(struct.unpack_from(f"<{n}i", header, end)) if n else []
    return block_hash, (parent if flags & _TAG_HAS_PARENT else None), tokens


def tag_block_hash(tag: bytes) -> int:
    """The block hash of a packed tag (the table entry repeats it)."""
    return _TAG.unpack_from(tag)[3]


@dataclass(frozen=True)
class TableEntry:
    key: bytes
    parent: Optional[bytes]
    generation: int
    length: int
    checksum: int
    block_hash: Optional[int] = None  # the page's router block hash, when it was written with a tag

    def pack(self) -> bytes:
        tagged = self.block_hash is not None
        body = _ENTRY.pack(_ENTRY_MAGIC, STATE_USED, ENTRY_TAGGED if tagged else 0, self.length, self.generation,
                           self.key, self.parent or _NO_PARENT, self.checksum,
                           struct.pack("<q", self.block_hash) if tagged else b"\x00" * 8)
        return body + _SB_CRC.pack(checksum(body))

    @staticmethod
    def unpack(raw: bytes) -> Optional["TableEntry"]:
        """The entry, or None for a free, never-written or damaged entry."""
        body = raw[:_ENTRY.size]
        magic, state, flags, length, gen, key, parent, csum, spare = _ENTRY.unpack(body)
        if magic != _ENTRY_MAGIC or state != STATE_USED:
            return None
        (crc,) = _SB_CRC.unpack_from(raw, _ENTRY.size)
        if crc != checksum(body):
            return None
        block_hash = struct.unpack("<q", spare)[0] if flags & ENTRY_TAGGED else None
        return TableEntry(key, None if parent == _NO_PARENT else parent, gen, length, csum, block_hash)


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

    def pack_into(self, buf: memoryview, tag: Optional[bytes] = None) -> None:
        """The header into `buf` (a whole header block, zeroed here), with a packed router tag if given."""
        body = _HDR.pack(_HDR_MAGIC, FORMAT_VERSION, 0, self.generation, self.length, self.checksum,
                         self.slot, self.key, self.parent or _NO_PARENT, bytes.fromhex(self.uuid))
        buf[:] = bytes(len(buf))
        buf[:len(body)] = body
        buf[len(body):len(body) + 4] = _SB_CRC.pack(checksum(body))
        if tag:
            buf[EVENT_OFFSET:EVENT_OFFSET + len(tag)] = tag

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
class LeaseRecord:
    """Who holds a partition: written with O_DIRECT into the partition's own block and read back.

    `token` is random per open: a holder that reads back someone else's token has lost the
    partition. `expires_ns` is wall-clock (hosts sharing a namespace must keep clocks in sync,
    as NTP does, to well under the lease time); `boot_id` and `pid`/`pid_start` let a process on
    the same host see at once that the previous holder is dead, without waiting for expiry.
    """

    state: int
    node_id: str
    host: str
    boot_id: bytes
    pid_ns: int
    pid: int
    pid_start: int
    token: bytes
    acquired_ns: int
    renewed_ns: int
    expires_ns: int

    def pack(self) -> bytes:
        body = _LEASE.pack(_LEASE_MAGIC, FORMAT_VERSION, self.state, 0, self.node_id.encode()[:48],
                           self.host.encode()[:64], self.boot_id[:16].ljust(16, b"\x00"), self.pid_ns, self.pid,
                           self.pid_start, self.token[:16].ljust(16, b"\x00"), self.acquired_ns,
                           self.renewed_ns, self.expires_ns)
        return (body + _SB_CRC.pack(checksum(body))).ljust(BLOCK, b"\x00")

    @staticmethod
    def unpack(block: bytes) -> Optional["LeaseRecord"]:
        """The record, or None for a never-written or damaged block."""
        body = bytes(block[:_LEASE.size])
        if len(block) < _LEASE.size + 4 or body[:4] != _LEASE_MAGIC:
            return None
        (crc,) = _SB_CRC.unpack_from(bytes(block[_LEASE.size:_LEASE.size + 4]))
        if crc != checksum(body):
            return None
        (_m, version, state, _f, node, host, boot, pid_ns, pid, start, token, acquired, renewed,
         expires) = _LEASE.unpack(body)
        if version != FORMAT_VERSION or state not in (LEASE_CLEAN, LEASE_HELD):
            return None
        return LeaseRecord(state, node.rstrip(b"\x00").decode(errors="replace"),
                           host.rstrip(b"\x00").decode(errors="replace"), boot, pid_ns, pid, start, token,
                           acquired, renewed, expires)
