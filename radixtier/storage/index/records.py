"""Prefix-index records: a fixed 48-byte binary layout, and the bulk decoder of a chain's page
values; nothing read from Redis is trusted.

Why binary and fixed-size: a 512-page chain lookup returns hundreds of records, and decoding each
msgpack map with per-field Python checks cost more than the round trip (3.2 ms of a 5.6 ms
lookup). Fixed 96-byte holder entries (node id + record) let the client check a whole chain with
a few numpy operations (`PageHolders`), building Python objects only for the pages it reads.

    record: offset  0  u8   version (2)
                    1  u8   tier (0 storage, 1 host)
                    2  u16  reserved (0)
                    4  16B  namespace uuid
                   20  u64  slot
                   28  u64  generation (>= 1)
                   36  u32  length (>= 1)
                   40  u32  checksum (CRC-32C of the page)
                   44  u32  published at (unix seconds)
    holder entry: 48-byte node id (UTF-8, NUL-padded), then the record
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
NODE_FIELD_BYTES = 48  # a node id (at most 48 bytes, radixtier/validate.py), NUL-padded
ENTRY_BYTES = NODE_FIELD_BYTES + RECORD_BYTES  # one holder of a page: node id, then its record
MAX_HOLDERS = 16  # entries a page's value keeps (writers replace the oldest beyond this)
ENTRY_DTYPE = np.dtype({"names": ["node", "v", "tier", "rsv", "ns", "slot", "gen", "len", "crc"],
                        "formats": ["V48", "u1", "u1", "<u2", "V16", "<u8", "<u8", "<u4", "<u4"],
                        "offsets": [0, 48, 49, 50, 52, 68, 76, 84, 88], "itemsize": ENTRY_BYTES})
_NS_WORD = ENTRY_DTYPE.fields["ns"][1] // 4  # the namespace's first 32-bit word in an entry


def node_field(node: str) -> bytes:
    """A node id as it sits in a page's value: UTF-8, NUL-padded to NODE_FIELD_BYTES."""
    raw = node.encode()
    if not 0 < len(raw) <= NODE_FIELD_BYTES:
        raise ValueError(f"node_id: {node!r} does not fit {NODE_FIELD_BYTES} bytes")
    return raw.ljust(NODE_FIELD_BYTES, b"\0")


def encode_record(rec: PageRecord) -> bytes:
    loc = rec.location
    return _REC.pack(RECORD_VERSION, _TIER_CODE[rec.tier], 0, bytes.fromhex(loc.namespace), loc.slot,
                     loc.generation, loc.length, loc.checksum, int(time.time()) & 0xFFFFFFFF)


def _distinct(fold: np.ndarray, lead: int) -> Tuple[np.ndarray, np.ndarray]:
    """(first row of each distinct value, each row's value index) of folded node ids, rows in page
    order. Pages of one chain mostly share their holders: the first page's few values are tried
    first (a search of each row among them), and the full sort runs only when another shows up."""
    cand, first = np.unique(fold[:lead], return_index=True)  # the first page's rows come first
    at = np.minimum(np.searchsorted(cand, fold), len(cand) - 1)
    if bool((cand[at] == fold).all()):
        return first, at
    _u, first, inverse = np.unique(fold, return_index=True, return_inverse=True)
    return first, inverse


class PageHolders:
    """The leading run of a chain as one MGET returned it (one value per page: its holders'
    entries), checked in bulk: entries that do not make sense are counted (`rejected`) and never
    used; dead nodes' and the caller's own entries are not found. Python objects are built only
    for what a caller asks for."""

    def __init__(self, values: Sequence[object], exclude: str = "") -> None:
        values = list(values)
        try:
            run = values.index(None)  # absent: the leading run ends there
        except ValueError:
            run = len(values)
        try:
            lengths = np.fromiter(map(len, values[:run]), dtype=np.int64, count=run)
        except TypeError:  # a value that is not a string (never from MGET): the run ends before it
            run = next(i for i, v in enumerate(values) if not isinstance(v, (bytes, bytearray)))
            lengths = np.fromiter(map(len, values[:run]), dtype=np.int64, count=run)
        # empty, foreign or oversized values end it too
        bad = np.flatnonzero((lengths == 0) | (lengths % ENTRY_BYTES != 0) | (lengths > ENTRY_BYTES * 4 * MAX_HOLDERS))
        if len(bad):
            run = int(bad[0])
        sizes = lengths[:run] // ENTRY_BYTES
        blob = b"".join(values[:run])
        self.rows = np.frombuffer(blob, dtype=ENTRY_DTYPE, count=len(blob) // ENTRY_BYTES)
        self._words = np.frombuffer(blob, dtype="<u4").reshape(-1, ENTRY_BYTES // 4)  # for word compares
        self.page = np.repeat(np.arange(run), sizes)
        self.pages = run
        r = self.rows
        valid = (r["v"] == RECORD_VERSION) & (r["tier"] <= 1) & (r["rsv"] == 0) & (r["gen"] >= 1) & (r["len"] >= 1)
        self.rejected = int(len(r) - np.count_nonzero(valid))
        # distinct holders: the 48-byte node fields folded to 64 bits (an integer sort, not a 48-byte one),
        # each fold's first row giving the name
        words = np.frombuffer(blob, dtype="<u8").reshape(-1, ENTRY_BYTES // 8)[:, :NODE_FIELD_BYTES // 8] \
            if len(r) else np.zeros((0, 6), dtype="<u8")
        lead = words[:, 0]  # the first 8 bytes tell most holders apart: a cheap no
        if not len(r):  # the first page is absent (a plain miss): no holders
            first, self._node_ix = np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
        elif bool((lead == lead[0]).all()) and bool((words == words[0]).all()):  # one holder: no sort
            first, self._node_ix = np.zeros(1, dtype=np.intp), np.zeros(len(r), dtype=np.intp)
        else:
            fold = words[:, 0].copy()
            for c in range(1, words.shape[1]):
                fold = fold * np.uint64(0x9E3779B97F4A7C15) ^ words[:, c]
            first, self._node_ix = _distinct(fold, int(sizes[0]))
        self.nodes = [bytes(r["node"][i]).rstrip(b"\0").decode("utf-8", errors="replace") for i in first.tolist()]
        mine = np.array([n == exclude for n in self.nodes] + [False], dtype=bool)[self._node_ix]
        self.ok = valid & ~mine

    def keep_nodes(self, live: Sequence[bool]) -> int:
        """Drop entries of nodes not alive (live[i] for nodes[i]); returns how many that ignored."""
        alive = np.array(list(live) + [False], dtype=bool)[self._node_ix]
        dropped = int(np.count_nonzero(self.ok & ~alive))
        self.ok &= alive
        return dropped

    def _first(self, mask: np.ndarray) -> Tuple[int, np.ndarray]:
        """(pages in the leading run with a usable entry, each such page's first usable entry)."""
        first = np.full(self.pages + 1, -1, dtype=np.int64)
        idx = np.nonzero(mask)[0]
        if len(idx):  # rows are in page order: a page's first usable row is where the page number changes
            pages = self.page[idx]
            starts = np.flatnonzero(np.r_[True, pages[1:] != pages[:-1]])
            first[pages[starts]] = idx[starts]
        missing = np.nonzero(first[:self.pages] < 0)[0]
        run = int(missing[0]) if len(missing) else self.pages
        return run, first[:run]

    def run_length(self) -> int:
        return self._first(self.ok)[0]

    def locations(self, namespace: str) -> List[LocationTuple]:
        """Leading run of pages a live holder has in tier 3 of `namespace`: one location each."""
        r = self.rows
        if len(r):
            # the namespace as four 32-bit words (a 16-byte void compare costs twice as much as all four)
            ns, w, at = np.frombuffer(bytes.fromhex(namespace), dtype="<u4"), self._words, _NS_WORD
            same = (w[:, at] == ns[0]) & (w[:, at + 1] == ns[1]) & (w[:, at + 2] == ns[2]) & (w[:, at + 3] == ns[3])
            run, rows = self._first(self.ok & (r["tier"] == 0) & same)
        else:
            run, rows = 0, []
        if run and int(rows[-1]) == run - 1:  # one usable entry per page, in order: a view, no gather
            sel = r[:run]
        else:
            sel = r[rows] if run else r[:0]
        return list(zip([namespace] * run, sel["slot"].tolist(), sel["gen"].tolist(), sel["len"].tolist(),
                        sel["crc"].tolist()))

    def records(self, cap: int) -> List[List[PageRecord]]:
        """Up to `cap` usable holders of each page of the leading run (a random sample when more
        hold it), as records."""
        run = self.run_length()
        out: List[List[PageRecord]] = [[] for _ in range(run)]
        r = self.rows
        idx = np.nonzero(self.ok & (self.page < run))[0]
        idx = idx[np.random.permutation(len(idx))]
        ns, slot, gen, length, crc, tier = (r["ns"].tolist(), r["slot"].tolist(), r["gen"].tolist(),
                                            r["len"].tolist(), r["crc"].tolist(), r["tier"].tolist())
        for j in idx.tolist():
            recs = out[int(self.page[j])]
            if len(recs) < cap:
                recs.append(PageRecord(self.nodes[int(self._node_ix[j])], TIERS[tier[j]],
                                       PageLocation(ns[j].hex(), slot[j], gen[j], length[j], crc[j])))
        return out
