"""TieredKVCache: spill/promote round trips, policies, failure handling, locking."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import PageHasher
from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.storage.api import PutResult
from radixtier.tiers import Tier

from radixtier.testing.cache import NUMEL, check_prefix, kv_for, make_cache

@pytest.fixture
def store(ns_file):
    s = NvmeofPageStore(ns_file, NUMEL * 4, create_bytes=8 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_round_trip_through_every_tier_preserves_bytes(ns4, store, policy):
    cache = make_cache(ns4, store, write_policy=policy, write_through_threshold=1)
    tokens = list(range(48))  # 12 pages
    assert cache.insert(tokens, kv_for(ns4, tokens)) == 12
    if policy == "write_through_selective":
        cache.acquire(tokens).release()  # one hit makes it hot: written through
    cache.flush()
    assert cache.evict(Tier.DEVICE, 16) >= 12
    if policy != "write_through":
        cache.flush()
        assert cache.tree.pages_in(Tier.HOST) == 12  # device eviction spilled to host
    # host eviction spills to storage (write_back writes it now; the others already did)
    cache.evict(Tier.HOST, 32)
    cache.flush()
    m = cache.match(tokens)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 0, 48)
    with cache.acquire(tokens, policy="wait_complete") as h:
        assert h.result.num_pages == 12
        assert h.result.hits_by_tier == {Tier.STORAGE: 48}
        check_prefix(cache, ns4, tokens, h.result)
    assert cache.match(tokens).device_tokens == 48
    cache.close()


def test_restart_finds_pages_written_before(ns4, ns_file):
    tokens = list(range(40))
    s = NvmeofPageStore(ns_file, NUMEL * 4, create_bytes=8 << 20)
    c = make_cache(ns4, s)
    c.insert(tokens, kv_for(ns4, tokens))
    c.close()
    s.close()
    s = NvmeofPageStore(ns_file, NUMEL * 4)
    c = make_cache(ns4, s)
    assert c.match(tokens).storage_tokens == 40
    with c.acquire(tokens, policy="wait_complete") as h:
        assert h.result.num_pages == 10
        check_prefix(c, ns4, tokens, h.result)
    c.close()
    s.close()


def test_partial_match_splits_and_extends(ns4):
    c = make_cache(ns4)
    a = list(range(32))
    b = a[:20] + [999] * 12
    c.insert(a, kv_for(ns4, a))
    m = c.match(b)
    assert m.prefix_tokens == 20 and m.device_tokens == 20
    with c.acquire(b) as h:
        assert h.result.num_pages == 5
        assert c.insert(b, kv_for(ns4, b, first_page=5), first_page=5) == 3
    with c.acquire(b) as h:
        assert h.result.num_pages == 8
        check_prefix(c, ns4, b, h.result)
    with c.acquire(a) as h:
        check_prefix(c, ns4, a, h.result)
    c.close()


def test_locked_pages_are_never_evicted(ns4, store):
    c = make_cache(ns4, store, device_pages=8, host_pages=8)
    a = list(range(32))  # exactly fills the device pool
    c.insert(a, kv_for(ns4, a))
    c.flush()
    h = c.acquire(a)
    assert h.result.num_pages == 8
    assert c.evict(Tier.DEVICE, 8) == 0  # every device page is locked
    b = list(range(100, 132))
    assert c.insert(b, kv_for(ns4, b)) == 0  # no room: not cached, and nothing of `a` moved out
    check_prefix(c, ns4, a, h.result)
    h.release()
    assert c.insert(b, kv_for(ns4, b)) == 8
    c.close()


class FlakyStore:
    """Wraps a real store; reads of chosen keys fail, writes can be refused."""

    def __init__(self, inner, bad_keys=(), refuse_writes=False, raise_on_get=False):
        self.inner, self.bad, self.refuse, self.raise_on_get = inner, set(bad_keys), refuse_writes, raise_on_get
        self.page_bytes, self.capacity_pages, self.uuid = inner.page_bytes, inner.capacity_pages, inner.uuid

    def put(self, keys, buffers, parents=None):
        if self.refuse:
            return PutResult([False] * len(keys))
        return self.inner.put(keys, buffers, parents)

    def get(self, keys, buffers):
        if self.raise_on_get:
            raise OSError("injected I/O error")
        ok = self.inner.get(keys, buffers)
        return [o and k not in self.bad for k, o in zip(keys, ok)]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_failed_transfer_never_marks_a_page_present(ns4, store):
    tokens = list(range(40))
    keys = PageHasher(ns4).chain(tokens)
    c = make_cache(ns4, store)
    c.insert(tokens, kv_for(ns4, tokens))
    c.flush()
    c.evict(Tier.DEVICE, 16)
    c.evict(Tier.HOST, 32)
    c.close()
    flaky = FlakyStore(store, bad_keys={keys[6]})
    c = make_cache(ns4, flaky)
    c.tree  # fresh tree: everything comes from storage
    with c.acquire(tokens, policy="wait_complete") as h:
        assert h.result.num_pages == 6  # page 6 failed: only the leading run before it is usable
        check_prefix(c, ns4, tokens, h.result)
    assert c.tree.pages_in(Tier.HOST) == 6
    assert c.stats()["failures"]["storage_to_host"] == 4
    c.close()
    raising = FlakyStore(store, raise_on_get=True)
    c = make_cache(ns4, raising)
    with c.acquire(tokens, policy="wait_complete") as h:
        assert h.result.num_pages == 0
    assert c.tree.pages_in(Tier.HOST) == 0 and c.host_pool.num_free == 32
    c.close()


def test_refused_storage_write_is_not_recorded(ns4, store):
    c = make_cache(ns4, FlakyStore(store, refuse_writes=True))
    tokens = list(range(16))
    c.insert(tokens, kv_for(ns4, tokens))
    c.flush()
    assert c.tree.pages_in(Tier.STORAGE) == 0
    assert c.tree.pages_in(Tier.HOST) == 4
    c.close()


class SlowStore(FlakyStore):
    def __init__(self, inner, delay):
        super().__init__(inner)
        self.delay = delay

    def get(self, keys, buffers):
        time.sleep(self.delay)
        return self.inner.get(keys, buffers)


def _stored_only(ns4, store, tokens):
    c = make_cache(ns4, store)
    c.insert(tokens, kv_for(ns4, tokens))
    c.close()


def test_prefetch_policies(ns4, store):
    tokens = list(range(32))
    _stored_only(ns4, store, tokens)
    slow = SlowStore(store, delay=0.4)
    c = make_cache(ns4, slow, promote_chunk_pages=8)
    t0 = time.monotonic()
    h = c.prefetch(tokens)
    r = h.load("best_effort")
    assert r.num_pages == 0 and time.monotonic() - t0 < 0.3  # did not wait for the slow read
    h.release()
    c.flush()
    c.close()
    c = make_cache(ns4, slow, promote_chunk_pages=8)
    h = c.prefetch(tokens)
    assert h.load("timeout", timeout=0.05).num_pages == 0
    h.release()
    c.flush()
    c.close()
    c = make_cache(ns4, slow, promote_chunk_pages=8)
    with c.prefetch(tokens) as h:
        r = h.load("wait_complete")
        assert r.num_pages == 8
        check_prefix(c, ns4, tokens, r)
    c.close()


def test_concurrent_requests_join_one_promotion(ns4, store):
    tokens = list(range(32))
    _stored_only(ns4, store, tokens)
    slow = SlowStore(store, delay=0.2)
    c = make_cache(ns4, slow)
    h1 = c.prefetch(tokens)
    h2 = c.prefetch(tokens)
    r1, r2 = h1.load("wait_complete"), h2.load("wait_complete")
    assert r1.num_pages == r2.num_pages == 8 and r1.device_slots == r2.device_slots
    assert c.stats()["pages_moved"]["storage_to_host"] == 8  # read once, not twice
    h1.release()
    h2.release()
    c.close()


@pytest.mark.parametrize("field, value, msg", [
    ("page_size", 0, "page_size"),
    ("device_pages", -1, "device_pages"),
    ("write_policy", "write_around", "write_policy: expected one of"),
    ("prefetch_policy", "eager", "prefetch_policy"),
    ("spill_watermark", 2.0, "spill_watermark"),
    ("eviction", "mru", "eviction"),
    ("page_shape", (0, 4), "page_shape"),
    ("device", "tpu", "device"),
])
def test_bad_configuration_is_named(ns4, field, value, msg):
    cfg = dict(page_size=4, page_shape=(NUMEL,), dtype=torch.int32, device="cpu")
    cfg[field] = value
    with pytest.raises(ValueError, match=msg):
        TieredKVCache(CacheConfig(**cfg), ns4)


def test_cuda_device_requested_without_cuda_is_a_clear_error(ns4):
    if torch.cuda.is_available():
        pytest.skip("CUDA is present on this machine")
    with pytest.raises(ValueError, match="CUDA is not available"):
        make_cache(ns4, device="cuda")


def test_store_page_size_mismatch_is_named(ns4, store):
    with pytest.raises(ValueError, match="page_bytes"):
        make_cache(ns4, store, page_shape=(NUMEL * 2,))


def test_bad_insert_shape_is_named(ns4):
    c = make_cache(ns4)
    with pytest.raises(ValueError, match="kv_pages"):
        c.insert(list(range(8)), torch.zeros(2, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens"):
        c.insert(list(range(4)), torch.zeros(2, NUMEL, dtype=torch.int32))
    c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_cuda_stream_round_trip(ns4, store):
    c = make_cache(ns4, store, device="cuda")
    tokens = list(range(32))
    c.insert(tokens, kv_for(ns4, tokens).cuda())
    c.flush()
    c.evict(Tier.DEVICE, 16)
    with c.acquire(tokens, policy="wait_complete") as h:
        got = c.gather(h.result.device_slots).cpu()
        assert torch.equal(got, kv_for(ns4, tokens))
    c.close()


@pytest.mark.parametrize("hints", [True, False])
def test_hold_hints_let_tier3_drop_what_memory_holds_and_write_it_back(ns4, ns_file, hints):
    """Tier 3 under pressure gives up the pages device/host hold first; when memory lets go of
    them they are written back down, so nothing is lost that was ever cached. The pressure is the
    cache's own traffic: a put's evictions reach the cache with the put's result."""
    store = NvmeofPageStore(ns_file, NUMEL * 4, create_bytes=600 << 10)  # 64 slots
    cache = make_cache(ns4, store, device_pages=8, host_pages=8, hold_hints=hints)

    def other_prompts(first: int, n: int) -> None:  # one-page prompts, each written through to tier 3
        for i in range(first, first + n):
            toks = list(range(1000 + 4 * i, 1004 + 4 * i))
            cache.insert(toks, kv_for(ns4, toks))
            assert cache.flush()

    other_prompts(0, store.capacity_pages - 5)
    assert cache.evict(Tier.DEVICE, 8) >= 0 and cache.evict(Tier.HOST, 8) >= 0  # memory holds none of them
    assert cache.flush()
    tokens = list(range(16))  # 4 pages, held in device and host, written through
    cache.insert(tokens, kv_for(ns4, tokens))
    assert cache.flush()
    hot = PageHasher(ns4).chain(tokens)
    more = list(range(5000, 5012))  # one 3-page prompt, one put: two slots short, two pages must go
    cache.insert(more, kv_for(ns4, more))
    assert cache.flush()
    if hints:
        assert store.exists(hot) == [False, False, True, True]  # held pages first: memory has them
    else:
        assert store.exists(hot) == [True] * 4  # leaves-first LRU took the two oldest other pages
    assert cache.evict(Tier.DEVICE, 8) >= 4 and cache.evict(Tier.HOST, 8) >= 4
    assert cache.flush()
    assert store.exists(hot) == [True] * 4  # written back down on the way out of memory
    with cache.acquire(tokens, "wait_complete") as h:
        assert h.result.num_pages == 4 and h.result.hits_by_tier.get(Tier.STORAGE) == 16
        check_prefix(cache, ns4, tokens, h.result)
    cache.close()
    store.close()


def test_refill_under_pressure_never_loses_the_node_it_fills(ns4):
    """Making room for a refilled prefix may evict its own child; the prefix must stay in the
    tree (regression: it was pruned, then given slots, and the next eviction raised KeyError)."""
    cache = make_cache(ns4, device_pages=1, host_pages=1, write_policy="write_through_selective")
    tokens = list(range(8))  # 2 pages of 4 tokens
    assert cache.insert(tokens[:4], kv_for(ns4, tokens[:4])) == 1
    cache.insert(tokens, kv_for(ns4, tokens, first_page=1), first_page=1)
    for _ in range(3):
        cache.insert(tokens, kv_for(ns4, tokens))
        cache.evict(Tier.DEVICE, 1)
        cache.evict(Tier.HOST, 1)
    for node in cache.tree.nodes():  # every node is reachable from the root
        up = node
        while up is not cache.tree.root:
            assert up.parent is not None and any(c is up for c in up.parent.children.values())
            up = up.parent
    for tier, pool in ((Tier.DEVICE, cache.device_pool), (Tier.HOST, cache.host_pool)):
        assert pool.num_free + cache.tree.pages_in(tier) == pool.num_pages  # no slot leaked or lost
    cache.close()


def test_refilling_a_path_that_must_be_chunked_puts_each_page_where_it_belongs(ns4):
    """Empty structural nodes on the insert's path are refilled from the caller's KV; when the
    device has no room for a whole node it is split into chunks on the way, and the nodes after
    it must still get their own pages (regression: the offset followed the shrunken node, so the
    next node was filled with the previous node's pages)."""
    cache = make_cache(ns4, device_pages=2, host_pages=32, promote_chunk_pages=2)
    tokens = list(range(48))  # 12 pages of 4 tokens
    cache.tree.insert(tokens[:16])  # pages 0-3 and 4-7 as structure only (e.g. tier 3 dropped them)
    cache.tree.insert(tokens[:32])
    assert cache.insert(tokens, kv_for(ns4, tokens)) == 12
    want = kv_for(ns4, tokens)
    seen = 0
    for node in cache.tree.match(tokens).nodes:
        pool, slots = (cache.device_pool, node.device) if node.device is not None else (cache.host_pool, node.host)
        got = pool.read(slots)
        for i in range(node.num_pages):
            assert torch.equal(got[i], want[node.start_page + i]), f"page {node.start_page + i} holds other bytes"
        seen += node.num_pages
    assert seen == 12
    cache.close()


def test_prefetch_never_evicts_the_prefix_it_just_planned(ns4, store):
    """Host room for a storage promotion must not come from the host pages planned before it."""
    c = make_cache(ns4, store, device_pages=1, host_pages=1, promote_chunk_pages=1)
    tokens = list(range(12))  # 3 pages, each written through to tier 3
    for p in range(3):
        c.insert(tokens[:4 * (p + 1)], kv_for(ns4, tokens[:4 * (p + 1)], first_page=p), first_page=p)
        c.flush()
    c.evict(Tier.DEVICE, 1)
    c.evict(Tier.HOST, 1)
    assert c.match(tokens).storage_tokens == 12
    with c.acquire(tokens[:4], policy="wait_complete") as h:  # page 0 back in memory
        assert h.result.num_pages == 1
    c.evict(Tier.DEVICE, 1)
    c.flush()
    m = c.match(tokens)
    assert (m.device_tokens, m.host_tokens, m.storage_tokens) == (0, 4, 8)
    with c.acquire(tokens, policy="wait_complete") as h:
        assert h.result.num_pages >= 1  # page 0 was planned from host: still there to load
        check_prefix(c, ns4, tokens, h.result)
    c.close()


class _SlowStore(NvmeofPageStore):
    """A store whose writes wait for a gate: stands in for a slow fdatasync on a busy device."""

    gate: threading.Event

    def put(self, keys, buffers, parents=None):
        assert self.gate.wait(30), "test gate never opened"
        return super().put(keys, buffers, parents)


def test_eviction_never_waits_on_tier3_writes_under_the_cache_lock(ns4, ns_file):
    """write_back: when a host victim must be written down first (the inline spill), the serving
    thread stages it and goes on; the write (and its fdatasync) runs on a transfer thread."""
    store = _SlowStore(ns_file, NUMEL * 4, create_bytes=8 << 20)
    store.gate = threading.Event()
    cache = make_cache(ns4, store, write_policy="write_back", device_pages=4, host_pages=4,
                       spill_watermark=1.0)  # no cleaner help: evictions must spill inline
    requests = [list(range(1000 * r, 1000 * r + 16)) for r in range(4)]  # 4 pages each
    done = threading.Event()

    def serve():
        for tokens in requests:
            cache.insert(tokens, kv_for(ns4, tokens))
        done.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert done.wait(10), "insert blocked on a tier-3 write while holding the cache lock"
    assert cache.stats()["inline_spill_pages"] > 0  # the path this pins was taken
    store.gate.set()
    assert cache.flush(30)
    for tokens in requests[:2]:  # spilled down while the writes were held back: tier 3 has them now
        with cache.acquire(tokens, policy="wait_complete") as h:
            assert h.result.num_pages == 4
            check_prefix(cache, ns4, tokens, h.result)
    cache.close()
    store.close()


def test_an_inserts_fill_mark_does_not_stick_to_a_split_head():
    from radixtier.cache.inflight import InFlight
    from radixtier.tree import Node
    import numpy as np

    table = InFlight()
    node, head = Node(1, None, np.zeros(0, dtype="<i8"), 0, (), []), Node(2, None, np.zeros(0, dtype="<i8"), 0, (), [])
    table.begin_fill(node)
    table.on_split(node, head)  # the insert's own chunking splits the node it is filling
    table.end_fill(node)
    assert not table.busy(node) and not table.busy(head)


def test_pages_are_hashed_only_when_tier_3_or_a_transfer_needs_their_keys(ns4, store, monkeypatch):
    """A match hashes nothing and KV that stays in device memory is never hashed; once a page goes
    to tier 3 its key is the chained hash of its tokens, as if it had been hashed at insert."""
    calls = []
    real_chain = PageHasher.chain

    def counting_chain(self, tokens, *args, **kwargs):
        out = real_chain(self, tokens, *args, **kwargs)
        calls.append(len(out))
        return out

    monkeypatch.setattr(PageHasher, "chain", counting_chain)
    memory_only = make_cache(ns4, device_pages=64, write_policy="write_back")
    tokens = list(range(64))  # 16 pages
    longer = tokens + list(range(500, 516))  # 4 more
    kv, kv_longer = kv_for(ns4, tokens), kv_for(ns4, longer)
    calls.clear()  # kv_for hashed them itself
    assert memory_only.insert(tokens, kv) == 16
    assert memory_only.match(tokens).prefix_tokens == 64
    assert memory_only.insert(longer, kv_longer) == 4
    assert memory_only.match(longer).prefix_tokens == 80
    assert calls == []
    memory_only.close()

    cache = make_cache(ns4, store, write_policy="write_through")
    want = kv_for(ns4, tokens)
    calls.clear()
    assert cache.insert(tokens, want) == 16
    assert cache.flush()
    assert sum(calls) == 16  # hashed once, for the copy down to tier 3
    assert cache.store.leading_run(PageHasher(ns4).chain(tokens)) == 16
    cache.close()


def test_array_q_tokens_match_as_lists_do(ns4):
    """array('q') (SGLang 0.5.23's token type) is viewed without a copy and matches like a list."""
    from array import array

    cache = make_cache(ns4, device_pages=64)
    tokens = list(range(40))  # 10 pages
    assert cache.insert(array("q", tokens), kv_for(ns4, tokens)) == 10
    assert cache.match(tokens).prefix_tokens == 40
    assert cache.match(array("q", tokens[:24] + [999] * 16)).prefix_tokens == 24
    assert cache.match(array("q", [7] * 40)).prefix_tokens == 0
    with pytest.raises(ValueError, match="non-negative"):
        cache.insert(array("q", [-1] * 4), kv_for(ns4, [0] * 4))
    cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_request_larger_than_the_host_pool_still_reaches_tier_3(ns4, store, policy):
    """New KV stays one node on the device; copying it down must not need host room for all of it
    at once (regression: a 40-page node with a 16-page host pool was never backed up, and a device
    eviction lost it whole)."""
    cache = make_cache(ns4, store, device_pages=64, host_pages=16, write_policy=policy, promote_chunk_pages=8)
    tokens = list(range(160))  # 40 pages
    assert cache.insert(tokens, kv_for(ns4, tokens)) == 40
    cache.flush()
    other = list(range(10_000, 10_240))  # 60 pages: pushes the first request out of the device
    assert cache.insert(other, kv_for(ns4, other)) == 60
    cache.flush()
    cache.evict(Tier.DEVICE, 64)
    cache.flush()
    assert store.leading_run(PageHasher(ns4).chain(tokens)) == 40
    assert cache.match(tokens).prefix_tokens == 160
    h = cache.prefetch(tokens)
    r = h.load("wait_complete")
    assert r.num_pages > 0
    check_prefix(cache, ns4, tokens, r)  # the bytes that came back up are the ones written
    h.release()
    cache.close()


def test_eviction_takes_what_is_needed_from_a_large_node_not_all_of_it(ns4):
    cache = make_cache(ns4, device_pages=256, host_pages=1024, promote_chunk_pages=8)
    big = list(range(800))  # 200 pages, one node
    assert cache.insert(big, kv_for(ns4, big)) == 200
    more = list(range(10**6, 10**6 + 256))  # 64 pages: 8 free slots short... 56 over
    assert cache.insert(more, kv_for(ns4, more)) == 64
    m = cache.match(big, beyond_memory=False)
    assert m.prefix_tokens == 800
    assert m.device_tokens >= (200 - 16) * 4  # only whole chunks covering the shortfall left the device
    cache.close()


def test_a_leaf_only_the_device_holds_gives_up_its_tail_in_place(ns4):
    """No copy is wanted (write_back, a host pool smaller than a chunk) and nothing else holds the
    pages: the victim loses whole chunks off its end, keeps its node and stays the oldest."""
    cache = make_cache(ns4, device_pages=256, host_pages=4, promote_chunk_pages=8, write_policy="write_back")
    big = list(range(800))  # 200 pages, one node
    cache.insert(big, kv_for(ns4, big))
    later = list(range(10**6, 10**6 + 160))  # 40 pages, more recently used
    cache.insert(later, kv_for(ns4, later))
    nodes = len(cache.tree)
    assert cache.evict(Tier.DEVICE, 20) == 24  # the whole chunks covering 20 pages
    assert len(cache.tree) == nodes  # no node made, none lost
    assert cache.evict(Tier.DEVICE, 8) == 8  # the oldest is still the oldest: it gives again
    assert cache.match(big, beyond_memory=False).prefix_tokens == (200 - 32) * 4
    assert cache.match(later, beyond_memory=False).prefix_tokens == 160
    for tokens in (big, later):
        h = cache.prefetch(tokens)
        r = h.load("wait_complete")
        check_prefix(cache, ns4, tokens, r)  # what stayed is the bytes inserted
        h.release()
    assert cache.stats()["free_slots"]["device"] == 256 - 168 - 40
    cache.close()


def test_every_hashed_page_is_found_at_its_index_after_splits(ns4, store):
    cache = make_cache(ns4, store, device_pages=64, write_policy="write_through")
    tokens = list(range(128))  # 32 pages, one node, hashed for its copy down
    cache.insert(tokens, kv_for(ns4, tokens))
    cache.flush()
    for cut in (3, 17, 9, 30):  # half hits split the node at these pages
        assert cache.match(tokens[:cut * 4] + [999_999] * 8).prefix_tokens == cut * 4
    tree = cache.tree
    assert len(tree) >= 5
    for node in tree.nodes():
        for i, key in enumerate(tree.page_keys(node)):
            assert tree.node_of_key(key) == (node, i)
    cache.close()


class GatedStore(FlakyStore):
    """Wraps a real store; each get waits at a gate after it was issued (a read still queued)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.issued, self.gate = threading.Event(), threading.Event()

    def get(self, keys, buffers):
        self.issued.set()
        assert self.gate.wait(10)
        return self.inner.get(keys, buffers)


def test_page_tier3_evicts_before_its_read_is_a_miss_not_a_failure(ns4, store):
    tokens = list(range(16))  # 4 pages, one promotion chunk
    keys = PageHasher(ns4).chain(tokens)
    _stored_only(ns4, store, tokens)
    gated = GatedStore(store)
    c = make_cache(ns4, gated, promote_chunk_pages=4)
    h = c.prefetch(tokens)  # planned from what tier 3 holds; the read waits at the gate
    assert gated.issued.wait(10)
    assert store.delete(keys[2:]) == 2  # tier 3 lets pages 2, 3 go meanwhile (as a put's eviction does)
    gated.gate.set()
    r = h.load("wait_complete")
    assert r.num_pages == 2  # the pages still held are served; the rest is a plain miss
    check_prefix(c, ns4, tokens, r)
    h.release()
    assert c.flush(timeout=10)
    assert not c.stats()["failures"], c.stats()["failures"]  # nothing failed: tier 3 evicted them
    assert c.tree.pages_in(Tier.HOST) == 2 and c.host_pool.num_used == 2
    c.close()
