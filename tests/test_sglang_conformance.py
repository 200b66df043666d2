"""radixtier as SGLang uses it: driven through SGLang 0.5.23's own UnifiedRadixCache and controller.

Nothing here calls RadixTierStorage directly: SGLang's controller threads do, from its own
backup and prefetch paths (see radixtier/testing/sglang_driver.py for the steps). The cache is built on CPU
pools with radixtier's CPU support layer; where CUDA is present that layer refuses to load, and
tests/test_sglang_server.py covers SGLang on the GPU through its real server.
Every K and V byte of every layer that SGLang loads back onto the device is checked.
"""

from __future__ import annotations

import pytest
import torch

from radixtier.testing.skips import require_sglang  # noqa: E402

require_sglang("radixtier.testing.sglang_driver")
from radixtier.testing.sglang_driver import SGLangNode  # noqa: E402

from radixtier.integrations.sglang.launch.cpu_support import cuda_present  # noqa: E402

if cuda_present():
    pytest.skip("CUDA present: SGLang's L1<->L2 copies are CUDA kernels, which CPU pools cannot use; "
                "the real-server tests run SGLang on the GPU", allow_module_level=True)

pytestmark = pytest.mark.sglang
PS = 16
PAGES = 8  # per request: 128 tokens


def seq(i: int, pages: int = PAGES) -> list:
    return list(range(100_000 * (i + 1), 100_000 * (i + 1) + pages * PS))


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def ns(tmp_path):
    return {"path": str(tmp_path / "ns.img"), "capacity": "128MiB"}


@pytest.mark.parametrize("prefetch_policy", ["best_effort", "wait_complete", "timeout"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_pages_evicted_under_allocation_pressure_come_back_byte_exact(ns, layout, write_policy, prefetch_policy):
    node = SGLangNode({**ns, "node_id": "a"}, layout=layout, write_policy=write_policy,
                      prefetch_policy=prefetch_policy, prefetch_timeout_s=30.0)
    try:
        assert node.layout == layout and type(node.backend).__name__ == "RadixTierStorage"
        # write_through_selective writes a prefix through once it was hit twice (SGLang's threshold)
        repeats = 3 if write_policy == "write_through_selective" else 1
        first = seq(0)
        want = node.insert(first, seed=1)
        for _ in range(repeats - 1):
            node.insert(first, seed=1)
        # more requests than L1 (32 pages) and L2 (65 pages) hold: SGLang evicts through its own
        # allocation path (alloc_token_slots -> evict); write_back backs up on the way down.
        # SGLang host-evicts only pages whose L2->L3 backup finished (a backup holds a host lock),
        # so each request's backups settle before the next arrives, as a scheduler's event loop
        # lets them between requests; without that, a slow disk (CI) leaves the first request in
        # L2 and SGLang drops later ones instead.
        node.settle_backups()
        for i in range(1, 15):
            for _ in range(repeats):
                node.insert(seq(i), seed=100 + i)
            node.settle_backups()
        m = node.match(first)
        assert m.device_prefix_len == 0 and m.host_hit_length == 0, "the first request should live only in L3"
        assert node.backend.radixtier_stats()["pages_written"] >= PAGES
        loaded = node.prefetch(first)
        if prefetch_policy != "best_effort":
            assert loaded == len(first)
        on_device = node.load_to_device(first)
        assert on_device == loaded
        if loaded:
            got = node.device_kv(first, 0, loaded)
            assert same(got, (want[0][:, :loaded], want[1][:, :loaded])), "bytes differ after the L3 round trip"
    finally:
        node.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_two_nodes_multi_turn_prefetch_served_by_the_other_nodes_pages(ns, redis_server, layout):
    """Node A serves a conversation (turn 1, then turn 2 extending it); node B, a fresh scheduler on
    the same namespace, gets the same conversation: its turn-1 prefetch and its continuation
    prefetch (anchored at turn 1's node, so SGLang passes no prefix keys) read A's pages."""
    common = {**ns, "redis_url": redis_server.url}
    a = SGLangNode({**common, "node_id": "node-a", "partition": 0}, layout=layout)
    b = SGLangNode({**common, "node_id": "node-b", "partition": 1}, layout=layout)
    try:
        turn1 = seq(0, pages=6)
        turn2 = turn1 + seq(1, pages=4)
        kv1 = a.insert(turn1, seed=11)
        kv2 = a.insert(turn2, seed=12)  # only turn 2's new pages are prefilled
        a.settle_backups()
        assert a.backend.flush(10)
        assert len(b.backend.store) == 0  # B holds nothing of its own
        # turn 1 on B: anchored at the root (no prefix keys)
        assert b.prefetch(turn1) == len(turn1)
        assert b.load_to_device(turn1) == len(turn1)
        assert same(b.device_kv(turn1, 0, len(turn1)), kv1)
        # turn 2 on B: turn 1 is cached there now; SGLang passes prefix keys of the anchor's
        # ancestors only ([] here) and the new pages' keys
        assert b.prefetch(turn2) == len(turn2) - len(turn1)
        assert b.load_to_device(turn2) == len(turn2)
        assert same(b.device_kv(turn2, len(turn1), len(turn2)), kv2)
        stats = b.backend.radixtier_stats()
        assert stats["pages_remote"] == len(turn2) // PS and stats["pages_local"] == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_an_mla_pool_round_trips_through_sglang(ns, layout):
    """SGLang's MLA pools (one latent buffer per layer) through the same path, byte-exact."""
    node = SGLangNode({**ns, "node_id": "mla"}, layout=layout, mla=True)
    try:
        assert node.backend.rank.is_mla
        first = seq(0)
        want = node.insert(first, seed=5)
        for i in range(1, 15):
            node.insert(seq(i), seed=200 + i)
        node.settle_backups()
        # allocation pressure alone need not push the first request out of L2 here (MLA pages are
        # small, and which host pages are evictable depends on when each backup landed): what this
        # test proves is the MLA pool's L3 round trip, so SGLang's own evict/evict_host finish the job
        node.evict_all()
        m = node.match(first)
        assert m.device_prefix_len == 0 and m.host_hit_length == 0
        assert node.prefetch(first) == len(first)
        assert node.load_to_device(first) == len(first)
        assert same(node.device_kv(first, 0, len(first)), want)
    finally:
        node.close()


@pytest.mark.parametrize("layout,fixed", [("page_first_direct", True), ("layer_first", False)])
def test_sglangs_host_pool_is_read_on_fixed_buffers_where_its_segments_are_large(ns, layout, fixed):
    """The backend registers SGLang's host pool (kv_buffer) with io_uring at attach; page_first_direct
    pages of this shape are two 256 KiB segments (K, V) and are read with READ_FIXED, layer_first
    ones are 4 x 128 KiB chunks (under the 256 KiB minimum) and stay one vectored read. Byte-exact
    either way."""
    from radixtier.storage.nvmeof.io_engine import uring_unusable_reason

    if uring_unusable_reason():
        pytest.skip(f"io_uring engine unavailable: {uring_unusable_reason()}")
    ps = 64  # 64 tokens x 8 heads x 128 dims x 2 bytes = 128 KiB per layer, K and V apart
    node = SGLangNode({**ns, "capacity": "64MiB", "partitions": 1, "node_id": "fx"}, layout=layout, page_size=ps,
                      layers=2, heads=8, head_dim=128, device_tokens=8 * ps)
    try:
        tokens = list(range(5, 5 + 4 * ps))
        want = node.insert(tokens, seed=21)
        node.settle_backups()
        node.evict_all()
        assert node.prefetch(tokens) == len(tokens)
        assert node.load_to_device(tokens) == len(tokens)
        assert same(node.device_kv(tokens, 0, len(tokens)), want)
        fixed_ios = node.backend.store.stats()["fixed_ios"]
        assert (fixed_ios == 2 * 4) if fixed else (fixed_ios == 0)
    finally:
        node.close()
