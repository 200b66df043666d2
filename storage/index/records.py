"""Prefix-index records: a fixed 48-byte binary layout, decoded one at a time or a whole chain at
once; nothing read from Redis is trusted.

Why binary and fixed-size: a 512-page chain lookup returns hundreds of records, and decoding each
msgpack map with per-field Python checks cost more than the round trip (3.2 ms of a 5.6 ms
lookup). A fixed layout lets the server skip anything of another size, and the client check a
whole chain with a few numpy comparisons (`decode_chain`), building Python objects only for the
pages it actually reads.

    offset  0  u8   version (2)
            1  u8   tier (0 storage, 1 host)
            2  u16  reserved (0)
            4  16B  namespace uuid
           20  u64  slot
           28  u64  generation (>= 1)
           36  u32  length (>= 1)
           40  u32  checksum (CRC-32C of the page)
           44  u32  published at (unix seconds)
"""

from __future__ import annotations

import struct
import time
from typing import List, Sequence, Tuple

import numpy as np

from radixtier.storage.api import HOST_TIER, STORAGE_TIER, LocationTuple, PageLocation, PageRecord

RECORD_VERSION = 2
RECORD_BYTES = 48
TIERS = (STORAGE_TIER, HOST_TIER)
_TIER_CODE = {STORAGE_TIER: 0, HOST_TIER: 1}
_REC = struct.Struct("<BBH16sQQIII")
assert _REC.size == RECORD_BYTES
ENTRY_BYTES = 16 + RECORD_BYTES  # a chain log entry: the page key, then its record
TOMBSTONE = bytes(RECORD_BYTES)  # version 0: the page was unpublished (a later entry may publish it again)
LOG_DTYPE = np.dtype({"names": ["key", "v", "tier", "rsv", "ns", "slot", "gen", "len", "crc"],
                      "formats": ["V16", "u1", "u1", "<u2", "V16", "<u8", "<u8", "<u4", "<u4"],
                      "offsets": [0, 16, 17, 18, 20, 36, 44, 52, 56], "itemsize": ENTRY_BYTES})

class RecordError(ValueError):
    """A record that does not decode or does not make sense; it is ignored, never used."""


def encode_record(rec: PageRecord) -> bytes:
    loc = rec.location
    return _REC.pack(RECORD_VERSION, _TIER_CODE[rec.tier], 0, bytes.fromhex(loc.namespace), loc.slot,
                     loc.generation, loc.length, loc.checksum, int(time.time()) & 0xFFFFFFFF)


def decode_record(raw: bytes, field_node: str) -> PageRecord:
    """One record, filed under node `field_node` (the hash field it was read from)."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != RECORD_BYTES:
        raise RecordError(f"expected {RECORD_BYTES} bytes, got {len(raw) if hasattr(raw, '__len__') else raw!r}")
    v, tier, rsv, ns, slot, gen, length, crc, _ts = _REC.unpack(raw)
    if v != RECORD_VERSION:
        raise RecordError(f"field 'version': expected {RECORD_VERSION}, got {v}")
    if tier > 1 or rsv:
        raise RecordError(f"field 'tier': expected 0 or 1, got {tier}")
    if not isinstance(field_node, str) or not 0 < len(field_node) <= 128:
        raise RecordError(f"node: expected a node id, got {field_node!r}")
    if gen < 1 or length < 1:
        raise RecordError(f"fields 'generation'/'length' must be >= 1, got {gen}/{length}")
    return PageRecord(field_node, TIERS[tier], PageLocation(ns.hex(), slot, gen, length, crc))


class _HolderLog:
    """One node's log for one chain, reduced (on first use) to its latest entry per page. A lookup
    walks holders in order and stops at the first that has a page, so usually only one is decoded."""

    __slots__ = ("node", "rows", "_where", "_good", "rejected")

    def __init__(self, node: str, blob: bytes) -> None:
        self.node = node
        self.rows = np.frombuffer(blob, dtype=LOG_DTYPE, count=len(blob) // ENTRY_BYTES)
        self._where = None
        self._good = None
        self.rejected = 0

    @property
    def where(self) -> dict:
        if self._where is None:
            rows = self.rows
            n = len(rows)
            self._where = dict(zip(rows["key"].tolist(), range(n)))  # later entries overwrite: the latest wins
            valid = (rows["v"] == RECORD_VERSION) & (rows["tier"] <= 1) & (rows["rsv"] == 0) & \
                    (rows["gen"] >= 1) & (rows["len"] >= 1)
            self._good = valid
            latest = np.zeros(n, dtype=bool)
            latest[list(self._where.values())] = True
            self.rejected = int(np.count_nonzero(latest & ~valid & (rows["v"] != 0)))
        return self._where

    @property
    def good(self) -> np.ndarray:
        self.where
        return self._good


class ChainLogs:
    """A chain's holders as one lookup returned them (node, log bytes), checked in bulk: entries that
    do not make sense are counted (`rejected`, over the holders a lookup had to read) and never used;
    unpublished pages (tombstones) and pages of dead nodes are not found. Python objects are built
    only for what a caller asks."""

    def __init__(self, pairs: Sequence[Tuple[str, bytes]]) -> None:
        self.holders = [_HolderLog(node, blob) for node, blob in pairs]
        self.nodes = [h.node for h in self.holders]

    @property
    def rejected(self) -> int:
        return sum(h.rejected for h in self.holders)

    def keep_nodes(self, live: Sequence[bool]) -> int:
        """Forget holders not alive (live[i] for holder i); returns how many entries that ignored."""
        dead = [h for h, ok in zip(self.holders, live) if not ok]
        self.holders = [h for h, ok in zip(self.holders, live) if ok]
        return sum(len(h.rows) for h in dead)

    def _run(self, keys: Sequence[bytes], usable) -> List[Tuple[_HolderLog, int]]:
        """(holder, row) of the first holder with a usable entry, per page of the leading run;
        usable(h) gives h's usable rows as a list of bools (built only for holders reached)."""
        out: List[Tuple[_HolderLog, int]] = []
        holders = self.holders
        ready: list = []  # (where.get, usable list) of holders reached so far, in order

        def reach(j: int):
            while len(ready) <= j:
                h = holders[len(ready)]
                ready.append((h, h.where.get, usable(h)))
            return ready[j]

        if not holders:
            return out
        h0, where0, ok0 = reach(0)
        for key in keys:
            i = where0(key)
            if i is not None and ok0[i]:  # the usual case: the first holder has it
                out.append((h0, i))
                continue
            for j in range(1, len(holders)):
                h, where, ok = reach(j)
                i = where(key)
                if i is not None and ok[i]:
                    out.append((h, i))
                    break
            else:
                break
        return out

    def run_length(self, keys: Sequence[bytes]) -> int:
        return len(self._run(keys, lambda h: h.good.tolist()))

    def locations(self, keys: Sequence[bytes], namespace: str) -> List[LocationTuple]:
        """Leading run of `keys` that a live holder has in tier 3 of `namespace`: one location each."""
        ns = np.frombuffer(bytes.fromhex(namespace), dtype="V16")[0]

        def usable(h: _HolderLog) -> list:
            r = h.rows
            return (h.good & (r["tier"] == 0) & (r["ns"] == ns)).tolist()

        run = self._run(keys, usable)
        cols = {}
        for h, _i in run:
            if h.node not in cols:  # whole columns at once: no numpy scalar per page
                r = h.rows
                cols[h.node] = (r["slot"].tolist(), r["gen"].tolist(), r["len"].tolist(), r["crc"].tolist())
        out: List[LocationTuple] = []
        for h, i in run:
            slot, gen, length, crc = cols[h.node]
            out.append((namespace, slot[i], gen[i], length[i], crc[i]))
        return out

    def records(self, keys: Sequence[bytes]) -> List[List[PageRecord]]:
        """Every usable holder of each page of the leading run, as records."""
        run = self.run_length(keys)
        out: List[List[PageRecord]] = [[] for _ in range(run)]
        for h in self.holders:
            where, good, r = h.where, h.good.tolist(), h.rows
            ns, slot, gen, length, crc, tier = (r["ns"].tolist(), r["slot"].tolist(), r["gen"].tolist(),
                                                r["len"].tolist(), r["crc"].tolist(), r["tier"].tolist())
            for p, key in enumerate(keys[:run]):
                i = where.get(key)
                if i is not None and good[i]:
                    out[p].append(PageRecord(h.node, TIERS[tier[i]],
                                             PageLocation(ns[i].hex(), slot[i], gen[i], length[i], crc[i])))
        return out


def live_entries(blob: bytes) -> Tuple[bytes, List[bytes], List[bytes]]:
    """A chain log compacted: (the latest entry of each page still published, in log order; the
    keys still published; the keys whose latest entry is a tombstone)."""
    n = len(blob) // ENTRY_BYTES
    rows = np.frombuffer(blob, dtype=LOG_DTYPE, count=n)
    latest = dict(zip(rows["key"].tolist(), range(n)))
    keep = sorted(i for i in latest.values() if rows["v"][i] != 0)
    gone = [k for k, i in latest.items() if rows["v"][i] == 0]
    return b"".join(blob[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES] for i in keep), \
        [blob[i * ENTRY_BYTES:i * ENTRY_BYTES + 16] for i in keep], gone
