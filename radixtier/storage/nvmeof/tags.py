"""Router tags read back: what a partition holds, named as a KV-aware router names it.

A page written with a router tag (layout.pack_tag: the engine's block hash, its parent's, the
page's token ids) keeps it in its slot header, and its table entry repeats the block hash. After
a restart a node announces what its partition holds from these (radixtier's tier-3 KV events):

- `announce_order` puts the partition's tagged entries in an order where a page comes after its
  parent whenever the parent is held here too (a router drops a stored block whose parent it does
  not know): by the newest generation on the page's chain, then by depth. It works on a copy of the
  slot table with numpy, so a partition of a million pages costs no Python object per page;
- `read_tags` reads the headers of one batch of those slots and proves each page before naming it:
  the header names this slot, key, generation, length, checksum and namespace, its tag is sound
  (CRC) and carries the block hash the entry repeats. A page whose data did not land (a crash
  before its entry was written) has no entry, so it is never named; one whose header was torn or
  overwritten fails the proof.

The store (store.py) runs these between its calls and checks, after each batch's reads, that the
partition still holds each page at that slot and generation; nothing here takes a lock.
`namespace_tags` does the same for a process that owns no partition (the pool's event stream).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from radixtier.storage.api import TaggedPage
from radixtier.storage.nvmeof.io_engine import make_engine
from radixtier.storage.nvmeof.layout import (BLOCK, ENTRY_BYTES, ENTRY_TAGGED, HEADER_BYTES, STATE_USED, SlotHeader,
                                             Superblock, unpack_tag)
from radixtier.storage.nvmeof.page_io import Geometry, header_matches, read_slot_headers
from radixtier.storage.nvmeof.target import open_target, read_aligned


_ENTRY = np.dtype([("magic", "<u2"), ("state", "u1"), ("flags", "u1"), ("length", "<u4"), ("gen", "<u8"),
                   ("key", "S16"), ("parent", "S16"), ("csum", "<u4"), ("hash", "<i8"), ("crc", "<u4")])
assert _ENTRY.itemsize == ENTRY_BYTES
_ENTRY_MAGIC = 0x5452
_MAX_JUMPS = 64  # pointer-jumping rounds: 2**64 covers any chain; what is left is a cycle


def announce_order(table: bytes, first_slot: int) -> np.ndarray:
    """Slots (absolute) of the tagged entries in `table` (a partition's slot table, first entry
    = `first_slot`), each after its parent where the parent is among them. Entries on a parent
    cycle (only a damaged or hostile table has one) are left out."""
    e = np.frombuffer(table, dtype=_ENTRY)
    idx = np.nonzero((e["magic"] == _ENTRY_MAGIC) & (e["state"] == STATE_USED) & ((e["flags"] & ENTRY_TAGGED) != 0))[0]
    if idx.size == 0:
        return idx.astype(np.int64)
    keys, parents, gens = e["key"][idx], e["parent"][idx], e["gen"][idx].astype(np.uint64)
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    pos = np.searchsorted(sorted_keys, parents)
    pos_c = np.minimum(pos, len(sorted_keys) - 1)
    anc = np.where(sorted_keys[pos_c] == parents, by_key[pos_c], -1).astype(np.int64)
    depth = (anc >= 0).astype(np.int64)
    newest = gens.copy()  # the newest generation on the page's chain, itself included
    for _ in range(_MAX_JUMPS):
        live = anc >= 0
        if not live.any():
            break
        a = anc[live]
        depth[live] += depth[a]
        newest[live] = np.maximum(newest[live], newest[a])
        nxt = anc.copy()
        nxt[live] = anc[a]
        anc = nxt
    keep = anc < 0
    order = np.lexsort((depth[keep], newest[keep]))
    return (idx[keep][order] + first_slot).astype(np.int64)


def read_tags(engine, geometry: Geometry, table: bytes, first_slot: int,
              slots: Sequence[int]) -> Tuple[List[TaggedPage], List[Tuple[int, int]], int]:
    """Read the slot headers of `slots` (from announce_order) and prove each page. Returns the
    proven pages, their (slot, generation) for the caller's still-held check, and how many failed."""
    heads = read_slot_headers(engine, geometry, slots, HEADER_BYTES)
    pages: List[TaggedPage] = []
    places: List[Tuple[int, int]] = []
    failed = 0
    for j, slot in enumerate(slots):
        i = (slot - first_slot) * ENTRY_BYTES
        ent = np.frombuffer(table, dtype=_ENTRY, count=1, offset=i)[0]
        view = heads[j]
        h = SlotHeader.unpack(view) if view is not None else None
        key, gen = bytes(table[i + 16:i + 32]), int(ent["gen"])
        tag = unpack_tag(view) if header_matches(h, slot, key, gen, int(ent["length"]), int(ent["csum"]),
                                                 geometry.uuid) else None
        if tag is None or tag[0] != int(ent["hash"]):
            failed += 1
            continue
        pages.append((key, tag[0], tag[1], tag[2]))
        places.append((slot, gen))
    return pages, places, failed


def namespace_tags(path: str, partitions: Optional[Sequence[int]] = None,
                   batch_pages: int = 256) -> Iterator[Tuple[int, List[TaggedPage]]]:
    """What a namespace's partitions hold, named, read by a process that owns none of them (the
    pool's event stream at start): (partition, pages) batches, parents first within a partition.
    Read-only, no lease taken: each page is proven by its header as it is read, but a partition's
    owner may evict a page right after (its owner's BlockRemoved then follows). FormatError for a
    target that is not a namespace; ValueError for a partition it does not have."""
    t = open_target(path, direct=False, readonly=True)
    engine = make_engine("threads", 16)
    try:
        sb = Superblock.unpack(read_aligned(t, 0, BLOCK), path)
        wanted = range(sb.partitions) if partitions is None else list(partitions)
        for p in wanted:
            if not 0 <= p < sb.partitions:
                raise ValueError(f"partition: {path} has partitions 0..{sb.partitions - 1}, got {p}")
        geometry = Geometry.of(t.fd, sb, 0, False)
        for p in wanted:
            slots = sb.partition_range(p)
            table = read_aligned(t, sb.entry_offset(slots.start), len(slots) * ENTRY_BYTES)
            order = announce_order(table, slots.start)
            for i in range(0, len(order), batch_pages):
                pages, _places, _failed = read_tags(engine, geometry, table, slots.start,
                                                    order[i:i + batch_pages].tolist())
                if pages:
                    yield p, pages
    finally:
        engine.close()
        t.close()
