"""Router tags (layout.pack_tag, tags.py, NvmeofPageStore.router_tags): what a KV-aware router names
each tier-3 page by, kept with the page, read back after a restart -- proven, parents first, never a
page whose data did not land or that left meanwhile."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from radixtier.storage.nvmeof.io_engine import uring_unusable_reason
from radixtier.storage.nvmeof.layout import EVENT_OFFSET, MAX_TAG_TOKENS, TableEntry, pack_tag, unpack_tag
from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.storage.nvmeof.tags import announce_order

PAGE = 4096
ENGINES = ["threads"] + ([] if uring_unusable_reason() else ["io_uring"])


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE // 4,), float(i))


def tag(i: int, parent: int | None, n: int = 4):
    return (1000 + i, None if parent is None else 1000 + parent, list(range(i * n, i * n + n)))


def named(store: NvmeofPageStore, batch: int = 256) -> list:
    return [(p[1], p[2], p[3]) for b in store.router_tags(batch) for p in b]


@pytest.mark.parametrize("engine", ENGINES)
def test_tags_come_back_after_a_restart_parents_first(tmp_path, engine):
    """A chain written children first (a later batch re-wrote its head) is named parents first; an
    untagged page is not named; every page still reads back."""
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, io_engine=engine)
    keys = [key(i + 1) for i in range(6)]
    parents = [None] + keys[:-1]
    tags = [tag(i, None if i == 0 else i - 1) for i in range(6)]
    assert all(s.put(keys[3:], [page(i) for i in range(3, 6)], parents[3:], tags[3:]).ok)
    assert all(s.put(keys[:3], [page(i) for i in range(3)], parents[:3], tags[:3]).ok)
    assert all(s.put([key(99)], [page(99)]).ok)  # no tag: a page a router was never told about
    s.close()
    s = NvmeofPageStore(path, PAGE, io_engine=engine)
    try:
        assert named(s, batch=2) == [tag(i, None if i == 0 else i - 1) for i in range(6)]
        assert (s.counters.tags_named, s.counters.tags_failed) == (6, 0)
        out = [torch.empty(PAGE // 4) for _ in range(7)]
        assert s.get(keys + [key(99)], out) == [True] * 7
    finally:
        s.close()


def test_a_torn_tag_or_an_entry_that_disagrees_is_never_named_and_the_page_still_serves(tmp_path):
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, io_engine="threads", direct=False)
    assert all(s.put([key(1), key(2)], [page(1), page(2)], [None, key(1)], [tag(1, None), tag(2, 1)]).ok)
    slot1 = s.location(key(1)).slot
    offset = s.sb.slot_offset(slot1) + EVENT_OFFSET + 30  # a token byte of page 1's tag
    s.close()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    from radixtier.storage.nvmeof.inspect import inspect_namespace

    report = inspect_namespace(path, verify=True)
    assert report["partitions"][0]["tagged"] == 2
    assert [e["error"] for e in report["errors"]] == ["router tag damaged or not the one its table entry names"]
    s = NvmeofPageStore(path, PAGE, io_engine="threads", direct=False)
    try:
        assert named(s) == [tag(2, 1)]  # page 2 names its parent's hash all the same
        assert s.counters.tags_failed == 1
        out = torch.empty(PAGE // 4)
        assert s.get([key(1)], [out]) == [True] and torch.equal(out, page(1))  # the tag is not the page
    finally:
        s.close()


def test_a_page_evicted_while_tags_are_read_is_never_named(tmp_path):
    """The order is taken at the first batch; pages evicted before their batch is read are skipped."""
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=2 << 20, io_engine="threads")
    try:
        cap = s.capacity_pages
        keys = [key(i + 1) for i in range(cap)]
        assert all(s.put(keys, [page(i) for i in range(cap)], None, [tag(i, None) for i in range(cap)]).ok)
        batches = s.router_tags(batch_pages=4)
        first = next(batches)
        assert len(first) == 4
        s.delete(keys[4:8])  # gone before their batch is read
        fresh = [key(1000 + i) for i in range(4)]
        assert all(s.put(fresh, [page(i) for i in range(4)], None, [tag(500 + i, None) for i in range(4)]).ok)
        rest = [p for b in batches for p in b]
        names = {p[0] for p in first + rest}
        assert not names & set(keys[4:8])
        assert names == set(keys) - set(keys[4:8])  # written after the order was taken: its writer announces it
    finally:
        s.close()


def test_a_namespace_written_before_tags_opens_and_serves_and_names_nothing(tmp_path):
    """Pages written without tags (as every radixtier before them wrote): read as ever, never named."""
    path = str(tmp_path / "ns.img")
    with NvmeofPageStore(path, PAGE, create_bytes=8 << 20) as s:
        assert all(s.put([key(1), key(2)], [page(1), page(2)], [None, key(1)]).ok)
    with NvmeofPageStore(path, PAGE) as s:
        assert named(s) == [] and s.counters.tags_failed == 0
        assert s.get([key(1), key(2)], [torch.empty(PAGE // 4), torch.empty(PAGE // 4)]) == [True, True]


def test_pack_and_unpack_refuse_what_they_cannot_hold():
    block = bytearray(4096)
    t = pack_tag((-5, 7, list(range(MAX_TAG_TOKENS))))
    block[EVENT_OFFSET:EVENT_OFFSET + len(t)] = t
    assert unpack_tag(bytes(block)) == (-5, 7, list(range(MAX_TAG_TOKENS)))
    too_many = pack_tag((1, None, list(range(MAX_TAG_TOKENS + 1))))  # named by its hashes, without tokens
    block[EVENT_OFFSET:EVENT_OFFSET + len(too_many)] = too_many
    assert unpack_tag(bytes(block)) == (1, None, [])
    assert pack_tag((1, None, [2 ** 40]))[:8] == pack_tag((1, None, []))[:8]  # not an int32 token id: none kept
    with pytest.raises(ValueError, match="int64"):
        pack_tag((2 ** 63, None, []))
    assert unpack_tag(bytes(4096)) is None


def test_the_order_survives_a_parent_cycle_and_a_million_entries(tmp_path):
    """A hostile table with a parent cycle ends (its entries left out); a million tagged entries,
    slots reused in any order, come out parents first (numpy over the table: no object per entry)."""
    cyc = b"".join(TableEntry(key(i), key(j), 1, 16, 0, 7).pack() for i, j in ((1, 2), (2, 1)))
    cyc += TableEntry(key(3), None, 2, 16, 0, 8).pack()
    assert announce_order(cyc, 10).tolist() == [12]
    n = 1 << 20
    e = np.zeros(n, dtype=[("magic", "<u2"), ("state", "u1"), ("flags", "u1"), ("length", "<u4"), ("gen", "<u8"),
                           ("key", "V16"), ("parent", "V16"), ("csum", "<u4"), ("hash", "<i8"), ("crc", "<u4")])
    e["magic"], e["state"], e["flags"], e["length"] = 0x5452, 1, 1, 16
    rng = np.random.default_rng(0)
    gens = rng.permutation(n).astype(np.uint64) + 1  # slots reused in any order
    keys = np.arange(1, n + 1, dtype=np.uint64)
    # 1,024 chains of 1,024 pages: page k's parent is page k-1 of its chain
    parents = np.where(keys % 1024 == 1, 0, keys - 1).astype(np.uint64)
    kb = np.zeros((n, 2), dtype=np.uint64)
    kb[:, 0] = keys
    pb = np.zeros((n, 2), dtype=np.uint64)
    pb[:, 0] = parents
    e["key"] = kb.view("V16").reshape(n)
    e["parent"] = pb.view("V16").reshape(n)
    e["gen"] = gens
    t0 = time.perf_counter()
    order = announce_order(e.tobytes(), 0)
    took = time.perf_counter() - t0
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    child = parents != 0
    assert len(order) == n
    assert (pos[np.nonzero(child)[0]] > pos[(parents[child] - 1).astype(np.int64)]).all()
    print(f"ordered {n} entries in {took:.2f} s")


@pytest.mark.skipif("io_uring" not in ENGINES, reason="io_uring unusable here")
def test_announcing_threads_leave_no_io_uring_ring_behind(tmp_path):
    """Each announcement runs on a thread of its own (one per /flush_cache): the ring its reads
    opened is closed once the thread has ended, not kept until the store closes."""
    import os
    import threading

    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=8 << 20, io_engine="io_uring")
    try:
        assert all(s.put([key(1)], [page(1)], None, [tag(1, None)]).ok)

        def announce_on_a_thread() -> None:
            t = threading.Thread(target=lambda: list(s.router_tags()))
            t.start()
            t.join()
        announce_on_a_thread()
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            announce_on_a_thread()
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        s.close()
