"""Each fact once on the write path: a put's result names where each stored page went and each
page it evicted, exactly once; the index and the event stream take them from it. (Before: the
slot table put each victim on two lists, so every page evicted by an SGLang write was unpublished
twice and announced twice, the repeat counted as an unnamed removal.)"""

from __future__ import annotations

import time

import pytest
import torch

from radixtier.storage.api import PageLocation, PageRecord
from radixtier.storage.nvmeof.layout import HEADER_BYTES
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace
from radixtier.testing.skips import require_sglang

PAGE = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE // 4,), i, dtype=torch.int32)


def small_store(tmp_path) -> NvmeofPageStore:
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=4 << 20)
    return NvmeofPageStore(path, PAGE)


def test_a_put_reports_each_location_and_each_victim_once_and_nothing_else_repeats_them(tmp_path):
    s = small_store(tmp_path)
    try:
        n = s.capacity_pages
        first = s.put([key(i) for i in range(n)], [page(i) for i in range(n)], [None] + [key(i) for i in range(n - 1)])
        assert all(first.ok) and first.evicted == [] and first.written == n
        assert first.locations == [tuple(vars(s.location(key(i))).values()) for i in range(n)]
        more = s.put([key(1000 + i) for i in range(5)], [page(1000 + i) for i in range(5)])
        assert all(more.ok) and len(more.evicted) == 5 and len(set(more.evicted)) == 5
        assert more.evicted == [key(i) for i in range(n - 1, n - 6, -1)]  # leaves first along the chain
        assert s.take_dropped() == []  # a victim is in its put's result, nowhere else
        again = s.put([key(1000), key(2000)], [page(1000), page(2000)])  # one held already, one new
        assert again.already_stored == 1 and again.written == 1 and again.ok == [True, True]
        assert again.locations[0] == more.locations[0]  # where it is, said again for the index
        rec = PageLocation(*again.locations[1])
        out = torch.zeros(PAGE // 4, dtype=torch.int32)
        assert s.read_locations([rec], [key(2000)], [out]) == [True] and torch.equal(out, page(2000))
    finally:
        s.close()


def test_a_page_a_read_drops_is_named_once_by_take_dropped(tmp_path):
    s = small_store(tmp_path)
    try:
        s.put([key(1), key(2)], [page(1), page(2)])
        loc = s.location(key(1))
        with open(s.path, "r+b") as f:  # one flipped payload bit
            f.seek(s.sb.slot_offset(loc.slot) + HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        out = [torch.zeros(PAGE // 4, dtype=torch.int32) for _ in range(2)]
        assert s.get([key(1), key(2)], out) == [False, True]
        assert s.take_dropped() == [key(1)] and s.take_dropped() == []
    finally:
        s.close()


def test_one_sglang_write_that_evicts_n_pages_unpublishes_n_records_and_announces_n_removals(tmp_path,
                                                                                            monkeypatch):
    require_sglang("sglang.srt.mem_cache.hicache_storage")
    from radixtier.testing.sglang_pools import attach, chain_keys, make_host_pool, slots

    host = make_host_pool("page_first")
    path = str(tmp_path / "ns.img")
    b = attach(host, {"path": path, "capacity": "3MiB", "partitions": 1, "interface_v1": 1,
                      "kv_events_endpoint": f"ipc://{tmp_path}/ev.sock"})
    try:
        capacity = b.store.capacity_pages
        unpublished, published = [], []
        index = b.index
        real_unpublish, real_publish = index.unpublish, index.publish
        monkeypatch.setattr(index, "unpublish", lambda keys: (unpublished.extend(keys), real_unpublish(keys))[1])
        monkeypatch.setattr(index, "publish", lambda root, keys, recs: (published.extend(recs),
                                                                        real_publish(root, keys, recs))[1])
        filled = 0
        while filled < capacity:  # the host pool holds 32 pages: fill tier 3 in chains of up to 32
            n = min(32, capacity - filled)
            assert all(b.batch_set_v1(chain_keys(n, f"fill-{filled}"), slots(0, n)))
            filled += n
        assert unpublished == [] and len(b.store) == capacity
        n = 8
        assert all(b.batch_set_v1(chain_keys(n, "evicting"), slots(0, n)))  # one write that evicts n pages
        assert len(unpublished) == n and len(set(unpublished)) == n, (len(unpublished), n)
        # the events thread builds removals from one queued record per write: wait until that
        # record is taken (the queue empty, the removal counted); the count is then final
        deadline = time.monotonic() + 10
        events = b.radixtier_stats()["kv_events"]
        while (events["queued"] or events["blocks_removed"] < n) and time.monotonic() < deadline:
            time.sleep(0.01)
            events = b.radixtier_stats()["kv_events"]
        assert events["blocks_removed"] == n and events["removals_unnamed"] == 0, events
        assert all(isinstance(r, PageRecord) and r.location.namespace == b.store.uuid for r in published)
        assert len(published) == capacity + n  # each stored page published once, at the put's location
    finally:
        b.close()


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_remote_pages_are_read_in_one_batch_at_their_locations(tmp_path, engine):
    """The store reads pages other nodes wrote by location in one verified batch (both engines);
    a stale, foreign or mis-sized location is a miss, not an exception."""
    from dataclasses import replace

    from radixtier.storage.nvmeof.io_engine import uring_unusable_reason

    if engine == "io_uring" and uring_unusable_reason():
        pytest.skip(uring_unusable_reason())
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=8 << 20, partitions=2)
    writer = NvmeofPageStore(path, PAGE, partition=0, node_id="w", io_engine=engine)
    reader = NvmeofPageStore(path, PAGE, partition=1, node_id="r", io_engine=engine)
    try:
        res = writer.put([key(i) for i in range(6)], [page(i) for i in range(6)])
        locs = [PageLocation(*t) for t in res.locations]
        locs[2] = replace(locs[2], generation=locs[2].generation + 1)  # stale
        locs[3] = replace(locs[3], namespace="0" * 32)  # another namespace
        outs = [torch.zeros(PAGE // 4, dtype=torch.int32) for _ in range(6)]
        outs[4] = torch.zeros(PAGE // 8, dtype=torch.int32)  # the record says another size
        ok = reader.read_locations(locs, [key(i) for i in range(6)], outs)
        assert ok == [True, True, False, False, False, True]
        assert torch.equal(outs[0], page(0)) and torch.equal(outs[5], page(5))
        assert reader.stats()["reads"] == 3 and writer.exists([key(2)]) == [True]  # nothing of the writer's freed
    finally:
        reader.close()
        writer.close()


def test_the_embedded_cache_unpublishes_a_page_tier_3_dropped(tmp_path):
    """A page a tier-3 read proves corrupt leaves the store (take_dropped) and the index: another
    node must not be sent to it again. (Before: the embedded cache told only its tree.)"""
    from radixtier.hashing import KVNamespace, PageHasher
    from radixtier.storage.index.inprocess import InProcessIndex, InProcessRegistry
    from radixtier.testing.cache import NUMEL, kv_for, make_cache

    ns = KVNamespace(model="m", dtype="int32", layout="flat", page_size=4)
    path = str(tmp_path / "ns.img")
    store = NvmeofPageStore(path, NUMEL * 4, create_bytes=8 << 20)
    registry = InProcessRegistry()
    index = InProcessIndex("a", registry)
    other = InProcessIndex("b", registry)  # a second node looks the pages up
    cache = make_cache(ns, store, index=index, write_policy="write_through")
    try:
        tokens = list(range(40))  # 10 pages
        keys = PageHasher(ns).chain(tokens)
        cache.insert(tokens, kv_for(ns, tokens))
        assert cache.flush() and cache._s.publisher.flush(5)
        assert len(other.lookup(keys[0], keys)) == 10
        loc = store.location(keys[3])
        with open(path, "r+b") as f:  # one flipped payload bit in page 3
            f.seek(store.sb.slot_offset(loc.slot) + HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        for j in range(1, 4):  # other traffic pushes the prompt out of device and host
            more = [10_000 * j + t for t in range(48)]
            cache.insert(more, kv_for(ns, more))
            cache.flush()
        assert cache.match(tokens).device_tokens == 0
        with cache.acquire(tokens, policy="wait_complete") as h:
            assert h.result.num_pages == 3  # the corrupt page and what follows it are not served
        with cache.acquire(tokens):  # the next plan learns what tier 3 dropped
            pass
        assert cache.flush() and cache._s.publisher.flush(5)
        assert len(other.lookup(keys[0], keys)) == 3
    finally:
        cache.close()
        store.close()


def test_a_put_that_raises_still_names_its_victims_through_take_dropped(tmp_path, monkeypatch):
    """The victims leave the index when the put is planned; if the write then raises there is no
    PutResult, so they must reach take_dropped (else never unpublished, never announced)."""
    s = small_store(tmp_path)
    try:
        n = s.capacity_pages
        assert all(s.put([key(i) for i in range(n)], [page(i) for i in range(n)]).ok)

        def broken(*_a, **_k):
            raise OSError(5, "injected")

        monkeypatch.setattr(s._io, "write", broken)
        with pytest.raises(OSError):
            s.put([key(1000 + i) for i in range(3)], [page(1000 + i) for i in range(3)])
        monkeypatch.undo()
        gone = s.take_dropped()
        assert len(gone) == 3 and not any(s.exists(gone)), gone
        assert s.num_free == 3 and len(s) == n - 3  # the slots back free, exactly once
    finally:
        s.close()


def test_a_page_already_stored_and_evicted_by_the_same_put_is_not_reported_stored(tmp_path):
    """A key the batch finds stored, then gives up as a later key's victim, is neither ok nor
    published at the slot now being overwritten."""
    s = small_store(tmp_path)
    try:
        n = s.capacity_pages
        assert all(s.put([key(i) for i in range(n)], [page(i) for i in range(n)]).ok)
        s.hold([key(0)])  # a faster tier holds it: the first victim
        res = s.put([key(0), key(5000)], [page(0), page(5000)])
        assert res.ok == [key(0) not in res.evicted, True], (res.ok, res.evicted)
        if key(0) in res.evicted:
            assert res.locations[0] is None and res.already_stored == 0
        assert res.ok[0] == s.exists([key(0)])[0]
    finally:
        s.close()


def test_a_dropped_key_written_again_stays_published(tmp_path):
    """A read drops a corrupt page; SGLang recomputes and backs it up again: after the write the
    index holds it (the drop's unpublish goes first, and only for pages still gone)."""
    from radixtier.storage.client import TierClient
    from radixtier.storage.index.inprocess import InProcessIndex, InProcessRegistry

    s = small_store(tmp_path)
    registry = InProcessRegistry()
    client = TierClient(s, InProcessIndex("a", registry))
    other = InProcessIndex("b", registry)
    try:
        client.write(key(1), [key(1), key(2)], [page(1), page(2)], [None, key(1)])
        loc = s.location(key(2))
        with open(s.path, "r+b") as f:
            f.seek(s.sb.slot_offset(loc.slot) + HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        out = [torch.zeros(PAGE // 4, dtype=torch.int32) for _ in range(2)]
        assert client.read(key(1), [key(1), key(2)], out).ok == [True, False]
        res = client.write(key(1), [key(2)], [page(2)], [key(1)])  # recomputed and backed up again
        assert res.put.ok == [True] and key(2) not in res.removed
        assert client.flush(5)
        assert len(other.lookup(key(1), [key(1), key(2)])) == 2
    finally:
        client.close()
