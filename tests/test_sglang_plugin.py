"""The SGLang 0.5.23 plugin against SGLang's real host pools and storage factory, on the CPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from radixtier.testing.skips import require_sglang  # noqa: E402

require_sglang("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy, PoolName,  # noqa: E402
                                                  PoolTransfer)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from radixtier.integrations.sglang.backend.attach import index_node_id  # noqa: E402
from radixtier.integrations.sglang.backend.radixtier_storage import RadixTierStorage  # noqa: E402
from radixtier.integrations.sglang.backend.config import ConfigError  # noqa: E402
from radixtier.integrations.sglang.backend.keys import RankIdentity  # noqa: E402
from radixtier.storage.nvmeof.layout import HEADER_BYTES  # noqa: E402
from radixtier.testing.sglang_pools import (PAGE, PageFirstOnlyHost, attach, attach_with_sidecar,  # noqa: E402
                                            chain_keys, make_host_pool, page_bytes, same_bytes, scramble, slots,
                                            storage_config)

pytestmark = pytest.mark.sglang
LAYOUTS = ("page_first", "layer_first")


@pytest.fixture
def ns(tmp_path):
    return {"path": str(tmp_path / "ns.img"), "capacity": "64MiB", "node_id": "node-a"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_zero_copy(ns, layout):
    host = make_host_pool(layout)
    b = attach(host, {**ns, "interface_v1": 1})
    keys = chain_keys(6)
    want = [page_bytes(host, p) for p in range(6)]
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    assert b.batch_set_v1(keys, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
    scramble(host, 10, 6)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 6
    assert b.batch_get_v1(keys, slots(10, 6), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
    assert [page_bytes(host, 10 + p) for p in range(6)] == want
    stats = b.radixtier_stats()
    assert stats["pages_local"] == 6 and stats["pages_written"] == 6 and stats["errors"] == 0
    b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_flat_round_trip(ns, layout):
    host = make_host_pool(layout, seed=1)
    b = attach(host, ns)
    keys = chain_keys(4, "legacy")
    values = [host.get_data_page(p * PAGE, flat=True) for p in range(4)]
    want = [v.clone() for v in values]
    assert b.batch_set(keys, values) is True
    assert all(b.exists(k) for k in keys) and not b.exists(chain_keys(1, "other")[0])
    assert b.batch_exists(keys + chain_keys(2, "tail")) == 4
    got = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None and same_bytes(g, w) for g, w in zip(got, want))
    single = b.get(keys[2], host.get_dummy_flat_data_page())
    assert same_bytes(single, want[2])
    assert b.get(chain_keys(1, "absent")[0], host.get_dummy_flat_data_page()) is None
    b.close()


def test_layer_first_v1_and_flat_pages_never_mix(ns):
    """The two interfaces order layer_first bytes differently: a page written by one is not read by the other."""
    host = make_host_pool("layer_first", seed=2)
    b = attach(host, ns)
    keys = chain_keys(2, "mix")
    assert all(b.batch_set_v1(keys, slots(0, 2)))
    assert b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
    b.close()


def test_restart_finds_earlier_pages(ns):
    host = make_host_pool("page_first", seed=3)
    keys = chain_keys(8, "restart")
    want = [page_bytes(host, p) for p in range(8)]
    b = attach(host, {**ns, "interface_v1": 1})
    assert all(b.batch_set_v1(keys, slots(0, 8), HiCacheStorageExtraInfo(prefix_keys=[])))
    b.close()
    host2 = make_host_pool("page_first", seed=99)
    b2 = attach(host2, {**ns, "interface_v1": 1})
    assert b2.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 8
    assert all(b2.batch_get_v1(keys, slots(4, 8)))
    assert [page_bytes(host2, 4 + p) for p in range(8)] == want
    b2.close()


def test_corrupted_page_reads_as_miss(ns):
    host = make_host_pool("page_first", seed=4)
    b = attach(host, {**ns, "interface_v1": 1})
    keys = chain_keys(5, "corrupt")
    assert all(b.batch_set_v1(keys, slots(0, 5)))
    skey = b.keys.chain(keys, None, b._format("kv"), "v1").keys[2]
    loc = b.store.location(skey)
    fd = os.open(ns["path"], os.O_RDWR)
    try:
        off = b.store.sb.slot_offset(loc.slot) + HEADER_BYTES + 100
        old = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    ok = b.batch_get_v1(keys, slots(10, 5))
    assert ok == [True, True, False, True, True]
    assert b.batch_exists(keys) == 2  # the bad slot is freed: it is never read again
    assert b.store.counters.corrupt == 1
    b.close()


def test_two_nodes_share_namespace_through_redis(ns, redis_server):
    host_a, host_b = make_host_pool("page_first", seed=5), make_host_pool("page_first", seed=6)
    common = {"path": ns["path"], "capacity": ns["capacity"], "redis_url": redis_server.url, "interface_v1": 1}
    a = attach(host_a, {**common, "node_id": "node-a", "partition": 0})
    bnode = attach(host_b, {**common, "node_id": "node-b", "partition": 1})
    keys = chain_keys(12, "shared-system-prompt")
    want = [page_bytes(host_a, p) for p in range(12)]
    assert all(a.batch_set_v1(keys[:8], slots(0, 8), HiCacheStorageExtraInfo(prefix_keys=[])))
    assert all(a.batch_set_v1(keys[8:], slots(8, 4), HiCacheStorageExtraInfo(prefix_keys=keys[:8])))
    assert a.flush(10)
    # node B has none of these pages locally; the index says node A holds them in this namespace
    assert bnode.store.leading_run(bnode.keys.chain(keys, None, bnode._format("kv"), "v1").keys) == 0
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:8])
    assert bnode.batch_exists(keys[:8], HiCacheStorageExtraInfo(prefix_keys=[])) == 8
    assert bnode.batch_exists(keys[8:], info) == 4
    assert all(bnode.batch_get_v1(keys[8:], slots(20, 4), info))
    assert all(bnode.batch_get_v1(keys[:8], slots(24, 8), HiCacheStorageExtraInfo(prefix_keys=[])))
    assert [page_bytes(host_b, p) for p in range(24, 32)] + [page_bytes(host_b, p) for p in range(20, 24)] == want
    assert bnode.radixtier_stats()["pages_remote"] == 12
    # node A goes away: its records stop being served (B's reads fall back to recompute, never stale bytes)
    a.close()
    time.sleep(1.2)  # readers cache the live-node set for up to heartbeat_s
    assert bnode.batch_exists(keys[:8], HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    bnode.close()


def test_two_backends_in_one_process_share_without_redis(ns):
    host_a, host_b = make_host_pool("page_first", seed=7), make_host_pool("page_first", seed=8)
    a = attach(host_a, {**ns, "node_id": "a", "partition": 0, "interface_v1": 1})
    bnode = attach(host_b, {**ns, "node_id": "b", "partition": 1, "interface_v1": 1})
    keys = chain_keys(3, "inproc")
    assert all(a.batch_set_v1(keys, slots(0, 3)))
    assert bnode.batch_exists(keys) == 3
    assert all(bnode.batch_get_v1(keys, slots(5, 3)))
    assert [page_bytes(host_b, 5 + p) for p in range(3)] == [page_bytes(host_a, p) for p in range(3)]
    a.close()
    bnode.close()


def test_tp_ranks_never_collide(ns):
    """Same SGLang keys on two TP ranks are two different pages (each rank holds its own heads)."""
    h0, h1 = make_host_pool("page_first", seed=10), make_host_pool("page_first", seed=11)
    r0 = attach(h0, {**ns, "interface_v1": 1}, tp_rank=0, tp_size=2)
    r1 = attach(h1, {**ns, "interface_v1": 1}, tp_rank=1, tp_size=2)
    assert r0.store.partition != r1.store.partition
    keys = chain_keys(3, "tp")
    assert all(r0.batch_set_v1(keys, slots(0, 3))) and all(r1.batch_set_v1(keys, slots(0, 3)))
    assert all(r0.batch_get_v1(keys, slots(8, 3))) and all(r1.batch_get_v1(keys, slots(8, 3)))
    assert [page_bytes(h0, 8 + p) for p in range(3)] == [page_bytes(h0, p) for p in range(3)]
    assert [page_bytes(h1, 8 + p) for p in range(3)] == [page_bytes(h1, p) for p in range(3)]
    assert page_bytes(h0, 8) != page_bytes(h1, 8)
    r0.close()
    r1.close()


def test_mla_only_the_storage_writer_writes(ns, redis_server):
    h0, h1 = make_host_pool("page_first", seed=12), make_host_pool("page_first", seed=13)
    extra = {**ns, "interface_v1": 1, "redis_url": redis_server.url}
    w = attach(h0, extra, tp_rank=0, tp_size=2, mla=True)
    r = attach(h1, extra, tp_rank=1, tp_size=2, mla=True)
    keys = chain_keys(4, "mla")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert all(r.batch_set_v1(keys, slots(0, 4), info))  # acknowledged; the writer rank stores it
    assert len(r.store) == 0 and r.radixtier_stats()["pages_skipped_not_writer"] == 4
    assert all(w.batch_set_v1(keys, slots(0, 4), info)) and len(w.store) == 4
    assert w.flush(10)
    assert r.batch_exists(keys, info) == 4
    assert all(r.batch_get_v1(keys, slots(8, 4), info))
    assert [page_bytes(h1, 8 + p) for p in range(4)] == [page_bytes(h0, p) for p in range(4)]
    w.close()
    r.close()


def fill_with_conversations(extra: dict):
    """Fill a small namespace, re-read one conversation's newest turn, then overflow it."""
    host = make_host_pool("page_first", seed=14)
    b = attach(host, extra)
    cap = b.store.capacity_pages
    chains = [chain_keys(8, f"conv{c}") for c in range(cap // 8 + 3)]

    def write(c):
        assert all(b.batch_set_v1(c[:4], slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])))
        assert all(b.batch_set_v1(c[4:], slots(4, 4), HiCacheStorageExtraInfo(prefix_keys=c[:4])))

    for c in chains[:cap // 8]:
        write(c)
    assert all(b.batch_get_v1(chains[0][4:], slots(8, 4), HiCacheStorageExtraInfo(prefix_keys=chains[0][:4])))
    for c in chains[cap // 8:]:
        write(c)
    fmt = b._format("kv")
    held = [b.store.exists(b.keys.chain(c, None, fmt, "v1").keys) for c in chains]
    parents = {k: p for k, p, _loc in b.store.entries()}
    last = b.keys.chain(chains[-1], None, fmt, "v1").keys
    b.close()
    return cap, held, parents, last


def test_prefix_keys_make_eviction_leaves_first(tmp_path):
    """Under pressure every stored chain stays a prefix: a parent never goes before its children."""
    cap, held, parents, last = fill_with_conversations(
        {"path": str(tmp_path / "small.img"), "capacity": "4MiB", "partitions": 1, "interface_v1": 1})
    assert parents[last[4]] == last[3]  # the parent link came from prefix_keys
    assert sum(map(sum, held)) <= cap
    assert all(h == sorted(h, reverse=True) for h in held), "a page was kept while its parent was evicted"
    assert any(any(h) for h in held) and not all(all(h) for h in held)


def test_plain_lru_breaks_chains_the_same_workload(tmp_path):
    """The comparison the tree order exists for: per-page LRU keeps the re-read turn, drops its prefix."""
    _cap, held, _parents, _last = fill_with_conversations(
        {"path": str(tmp_path / "small.img"), "capacity": "4MiB", "partitions": 1, "interface_v1": 1,
         "eviction": "lru"})
    assert held[0] == [False] * 4 + [True] * 4


def test_sidecar_pools_v2(ns):
    host = make_host_pool("page_first", seed=15)
    side = make_host_pool("page_first", seed=16, layers=1)
    b = StorageBackendFactory.create_backend("dynamic", storage_config({**ns, "interface_v1": 1}), host)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    b.register_mem_host_pool_v2(side, PoolName.MAMBA)
    b.on_host_pools_registered()
    keys = chain_keys(6, "hybrid")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert all(b.batch_set_v1(keys, slots(0, 6), info))
    tail = PoolTransfer(name=PoolName.MAMBA, host_indices=slots(3, 3), keys=keys[3:],
                        hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert b.batch_set_v2([tail], info) == {"mamba": [True] * 3}
    res = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:],
                                                hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert res.kv_hit_pages == 6 and res.extra_pool_hit_pages["mamba"] == 6
    need_all = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys,
                                                     hit_policy=PoolHitPolicy.ALL_PAGES)], info)
    assert need_all.kv_hit_pages == 0  # mamba pages 0..2 were never stored
    want = [page_bytes(side, p) for p in range(3, 6)]
    scramble(side, 10, 3)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(10, 3), keys=keys[3:],
                                       hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    assert got == {"mamba": [True] * 3}
    assert [page_bytes(side, p) for p in range(10, 13)] == want
    b.close()


def test_metrics_for_sglang(ns):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host = make_host_pool("page_first", seed=17)
    b = attach(host, {**ns, "interface_v1": 1})
    keys = chain_keys(4, "metrics")
    b.batch_set_v1(keys, slots(0, 4))
    b.batch_get_v1(keys, slots(4, 4))
    m = b.get_stats()
    assert isinstance(m, StorageMetrics) and m.prefetch_pgs == [4] and m.backup_pgs == [4]
    assert m.prefetch_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []  # per interval
    assert b.clear() is True and b.batch_exists(keys) == 0
    b.close()


@pytest.mark.parametrize("extra, field", [
    ({"redis_ulr": "redis://x"}, "redis_url"),
    ({"queue_depth": "many"}, "queue_depth"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"io_engine": "spdk"}, "io_engine"),
    ({"capacity": "lots"}, "capacity"),
    ({"direct": "maybe"}, "direct"),
    ({"redis_url": "http://x"}, "redis_url"),
    ({"node_id": "a:b"}, "node_id"),
    ({"eviction": "fifo"}, "eviction"),
    ({"path": ""}, "path"),
    ({"heartbeat_s": "nan"}, "heartbeat_s"),
    ({"lookup_timeout_s": "inf"}, "lookup_timeout_s"),
    ({"connect_timeout_s": float("nan")}, "connect_timeout_s"),
    ({"ssl_ca_certs": "/nonexistent/ca.pem"}, "ssl_ca_certs: /nonexistent/ca.pem"),
    ({"ssl_certfile": "/nonexistent/cert.pem"}, "ssl_certfile: /nonexistent/cert.pem"),
    ({"ssl_keyfile": "/nonexistent/key.pem"}, "ssl_keyfile: /nonexistent/key.pem"),
])
def test_bad_config_names_the_key(ns, extra, field):
    with pytest.raises(ConfigError, match=field):
        RadixTierStorage(storage_config({**ns, **extra}), {})


def test_bad_namespace_config_fails_the_attach(tmp_path, ns):
    host = make_host_pool("page_first")
    with pytest.raises(ConfigError, match="path: .* does not exist; set capacity"):
        attach(host, {"path": str(tmp_path / "missing.img")})
    with pytest.raises(ConfigError, match="redis_url: required for an MLA model"):
        RadixTierStorage(storage_config(ns, tp_rank=0, tp_size=2, mla=True), {})
    small = make_host_pool("page_first", layers=1)
    attach(small, ns).close()  # formats the namespace for 1-layer pages
    with pytest.raises(ConfigError, match="page_bytes: .* holds pages of"):
        attach(host, ns)
    other = tmp_path / "not-a-namespace"
    other.write_bytes(b"precious data" * 1000)
    with pytest.raises(ConfigError, match="path"):
        attach(host, {"path": str(other)})
    assert other.read_bytes() == b"precious data" * 1000


def test_errors_become_misses_not_exceptions(ns, caplog):
    host = make_host_pool("page_first")
    b = attach(host, {**ns, "interface_v1": 1})
    keys = chain_keys(2, "err")
    with caplog.at_level(logging.ERROR, logger="radixtier.sglang"):
        assert b.batch_set_v1(keys, slots(0, 1)) == [False, False]  # too few host slots
        assert b.batch_get_v1(keys, slots(0, 3)) == [False, False]
    assert "host_indices" in caplog.text and b.radixtier_stats()["errors"] == 2
    b.close()


def test_entry_point_hooks_sglangs_argument_check():
    """SGLang loads plugins before it configures logging: register() logs nothing, it hooks check_server_args."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from radixtier.integrations.sglang.launch.plugin import CHECK_TARGET, after_check_server_args

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "radixtier"]
    assert eps, "radixtier is not installed with its sglang.srt.plugins entry point"
    assert eps[0].load()() is True
    assert (HookType.AFTER, after_check_server_args) in [(t, h) for t, h, _src in HookRegistry._hooks[CHECK_TARGET]]


def _server_args(extra, policy="wait_complete", backend="dynamic"):
    import json as _json

    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", enable_hierarchical_cache=True, hicache_storage_backend=backend,
                      hicache_storage_prefetch_policy=policy,
                      hicache_storage_backend_extra_config=None if extra is None else _json.dumps(extra))


def test_argument_check_hook_checks_logs_and_warns(ns, caplog):
    from radixtier.integrations.sglang.launch.plugin import after_check_server_args, backend_extra_config

    with caplog.at_level(logging.INFO, logger="radixtier.sglang"):
        assert after_check_server_args("r", _server_args(None, backend="file")) == "r"
        assert "available; select it with --enable-hierarchical-cache" in caplog.text
        caplog.clear()
        after_check_server_args(None, _server_args(backend_extra_config(**ns)))
        assert f"L3 backend: namespace {ns['path']}" in caplog.text and "best_effort" not in caplog.text
        after_check_server_args(None, _server_args(backend_extra_config(**ns), policy="best_effort"))
        assert "best_effort" in caplog.text and "use wait_complete" in caplog.text
    with pytest.raises(ConfigError, match="unknown key 'redis_ulr'; did you mean 'redis_url'"):
        after_check_server_args(None, _server_args(backend_extra_config(**ns, redis_ulr="redis://x")))
    assert not os.path.exists(ns["path"])  # checked before anything is opened


def test_backup_counts_only_pages_it_wrote(ns, caplog):
    """A backup of pages tier 3 already holds writes nothing: SGLang's backup figures and the written
    count leave them out, and they are counted (and said once) as SGLang recomputing what it could load."""
    host = make_host_pool("page_first", seed=5)
    b = attach(host, {**ns, "interface_v1": 1})
    keys = chain_keys(6, "rebackup")
    assert all(b.batch_set_v1(keys[:4], slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])))
    assert b.get_stats().backup_pgs == [4]
    with caplog.at_level(logging.WARNING, logger="radixtier.sglang"):
        assert all(b.batch_set_v1(keys, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])))
        assert all(b.batch_set_v1(keys, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])))
    m = b.get_stats()
    assert m.backup_pgs == [2] and len(m.backup_bandwidth) == 1
    totals = b.radixtier_stats()
    assert totals["pages_written"] == 6 and totals["pages_already_stored"] == 4 + 6
    assert totals["store"]["writes"] == 6
    assert caplog.text.count("already holds") == 1
    b.close()


def test_ranks_creating_one_namespace_at_once_leave_only_the_namespace(tmp_path):
    """Ranks of a node find the file missing together: one formats it, all open it, and the creation
    lock (flock on the folder) leaves no file beside the namespace."""
    import threading

    folder = tmp_path / "fleet"
    hosts = [make_host_pool("page_first", seed=r) for r in range(4)]
    out, errors = [None] * 4, []

    def rank(r):
        try:
            out[r] = attach(hosts[r], {"path": str(folder / "ns.img"), "capacity": "64MiB", "node_id": "n"},
                            tp_rank=r, tp_size=4)
        except Exception as exc:  # pragma: no cover - the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({b.store.uuid for b in out}) == 1 and sorted(b.store.partition for b in out) == [0, 1, 2, 3]
    for b in out:
        b.close()
    assert os.listdir(folder) == ["ns.img"]


def test_tls_files_that_exist_are_accepted(ns, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    RadixTierStorage(storage_config({**ns, "ssl_ca_certs": str(ca)}), {})  # opened lazily: nothing to close


def test_rank_identity_counts_dp():
    """0.5.23's config has dp_rank but no dp_size: only a node's one process keeps the plain node_id."""
    assert RankIdentity("m").is_sole_rank()
    assert not RankIdentity("m", dp_rank=1).is_sole_rank()
    assert not RankIdentity("m", tp_size=2).is_sole_rank()
    assert RankIdentity("m", dp_rank=1).rank_index() != RankIdentity("m", dp_rank=2).rank_index()
    assert index_node_id("node-a", 3, False) == "node-a.r3" and index_node_id("node-a", 0, True) == "node-a"


def test_dp_ranks_have_their_own_identity_and_partition(ns, redis_server):
    """Attention-DP ranks of one node: distinct partitions and index identities, so one rank's
    unpublish or close() does not take its siblings' records with it."""
    common = {"path": ns["path"], "capacity": ns["capacity"], "redis_url": redis_server.url, "interface_v1": 1}
    h0, h1, hb = (make_host_pool("page_first", seed=s) for s in (30, 31, 32))
    dp0 = attach(h0, {**common, "node_id": "node-a"}, dp_rank=0)
    dp1 = attach(h1, {**common, "node_id": "node-a"}, dp_rank=1)
    other = attach(hb, {**common, "node_id": "node-b", "partition": 2})
    assert dp0.store.partition != dp1.store.partition
    assert dp0.node_id != dp1.node_id
    keys = chain_keys(4, "dp")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    for rank in (dp0, dp1):  # the same prefix on both DP ranks: the same store keys
        assert all(rank.batch_set_v1(keys, slots(0, 4), info)) and rank.flush(10)
    assert dp1.clear() and dp1.flush(10)  # unpublishes dp1's records only
    assert other.batch_exists(keys, info) == 4
    dp1.close()
    time.sleep(1.2)  # readers cache the live-node set for up to heartbeat_s
    assert other.batch_exists(keys, info) == 4  # dp0 is alive; its records still count
    assert all(other.batch_get_v1(keys, slots(8, 4), info))
    assert [page_bytes(hb, 8 + p) for p in range(4)] == [page_bytes(h0, p) for p in range(4)]
    dp0.close()
    other.close()


@pytest.mark.parametrize("pool, policy", [(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES),
                                          (PoolName.SWA, PoolHitPolicy.TRAILING_PAGES)])
def test_replicated_sidecar_found_through_the_index(ns, redis_server, pool, policy):
    """MLA: only the writer rank stores replicated sidecars (DSA indexer, SWA state); the other
    ranks must find them through the index, as they do the KV."""
    extra = {**ns, "interface_v1": 1, "redis_url": redis_server.url}
    hw, sw = make_host_pool("page_first", seed=40), make_host_pool("page_first", seed=41, layers=1)
    hr, sr = make_host_pool("page_first", seed=42), make_host_pool("page_first", seed=43, layers=1)
    w = attach_with_sidecar(hw, sw, pool, extra, tp_rank=0, tp_size=2, mla=True)
    r = attach_with_sidecar(hr, sr, pool, extra, tp_rank=1, tp_size=2, mla=True)
    keys = chain_keys(6, f"side-{pool.value}")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    first = 0 if policy == PoolHitPolicy.ALL_PAGES else 3  # a trailing pool stores the last pages only
    side_info = HiCacheStorageExtraInfo(prefix_keys=keys[:first])  # what SGLang sends: prefix + keys contiguous
    transfer = PoolTransfer(name=pool, host_indices=slots(first, 6 - first), keys=keys[first:], hit_policy=policy)
    for b in (w, r):
        assert all(b.batch_set_v1(keys, slots(0, 6), info))
        assert b.batch_set_v2([transfer], side_info) == {pool.value: [True] * (6 - first)}
    assert len(r.store) == 0 and w.flush(10)
    query = PoolTransfer(name=pool, keys=keys if first == 0 else keys[-1:], hit_policy=policy)
    res = r.batch_exists_v2(keys, [query], info)
    assert res.kv_hit_pages == 6 and res.extra_pool_hit_pages[pool.value] == 6
    got = r.batch_get_v2([PoolTransfer(name=pool, host_indices=slots(10, 6 - first), keys=keys[first:],
                                       hit_policy=policy)], side_info)
    assert got == {pool.value: [True] * (6 - first)}
    assert [page_bytes(sr, 10 + p) for p in range(6 - first)] == [page_bytes(sw, p) for p in range(first, 6)]
    w.close()
    r.close()


def test_sidecar_without_zero_copy_layout_uses_flat_pages(ns):
    """Mamba/DSA host pools raise from get_page_buffer_meta outside page_first: probe once, use flat pages."""
    host = make_host_pool("layer_first", seed=44)
    side = make_host_pool("layer_first", seed=45, layers=1, cls=PageFirstOnlyHost)
    b = attach_with_sidecar(host, side, PoolName.MAMBA, ns)
    keys = chain_keys(3, "flat-side")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    want = [page_bytes(side, p) for p in range(3)]
    assert b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(0, 3), keys=keys)], info) == \
        {"mamba": [True] * 3}
    scramble(side, 8, 3)
    assert b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots(8, 3), keys=keys)], info) == \
        {"mamba": [True] * 3}
    assert [page_bytes(side, 8 + p) for p in range(3)] == want
    assert b.radixtier_stats()["errors"] == 0
    b.close()


def test_missing_prefix_keys_with_redis_warns_once(ns, redis_server, caplog):
    host = make_host_pool("page_first", seed=46)
    with caplog.at_level(logging.WARNING, logger="radixtier.sglang"):
        b = attach(host, {**ns, "interface_v1": 1, "redis_url": redis_server.url})
        assert all(b.batch_set_v1(chain_keys(2, "p0"), slots(0, 2), HiCacheStorageExtraInfo(prefix_keys=[])))
        assert "hicache_storage_pass_prefix_keys" not in caplog.text
        for seed in ("p1", "p2"):
            assert all(b.batch_set_v1(chain_keys(2, seed), slots(0, 2)))
    assert caplog.text.count("hicache_storage_pass_prefix_keys") == 1
    b.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixtier.sglang"):
        attach(host, {**ns, "redis_url": redis_server.url}).close()  # legacy interface: never any prefix keys
    assert "interface_v1" in caplog.text and "hicache_storage_pass_prefix_keys" in caplog.text


def test_mla_non_writer_legacy_batch_set_writes_nothing(ns, redis_server):
    host = make_host_pool("page_first", seed=47)
    r = attach(host, {**ns, "redis_url": redis_server.url}, tp_rank=1, tp_size=2, mla=True)
    keys = chain_keys(3, "legacy-mla")
    assert r.batch_set(keys, [host.get_data_page(p * PAGE, flat=True) for p in range(3)]) is True
    assert len(r.store) == 0 and r.radixtier_stats()["pages_skipped_not_writer"] == 3
    r.close()


def test_redis_down_never_reaches_sglang(ns, redis_server):
    """Redis killed under a running backend: every call keeps answering from local pages, quickly."""
    host = make_host_pool("page_first", seed=48)
    b = attach(host, {**ns, "interface_v1": 1, "redis_url": redis_server.url})
    keys = chain_keys(8, "redis-down")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    want = [page_bytes(host, p) for p in range(8)]
    assert all(b.batch_set_v1(keys[:4], slots(0, 4), info)) and b.flush(10)
    redis_server.kill()
    t0 = time.monotonic()
    assert all(b.batch_set_v1(keys[4:], slots(4, 4), HiCacheStorageExtraInfo(prefix_keys=keys[:4])))
    assert b.batch_exists(keys, info) == 8
    assert b.batch_exists(keys + chain_keys(2, "never-written"), info) == 8  # the remote lookup fails: a miss
    assert b.exists(chain_keys(1, "absent")[0]) is False
    scramble(host, 8, 8)
    assert all(b.batch_get_v1(keys, slots(8, 8), info))
    assert [page_bytes(host, 8 + p) for p in range(8)] == want
    assert time.monotonic() - t0 < 5
    assert b.radixtier_stats()["errors"] == 0
    b.close()


def test_stale_remote_record_reads_as_a_miss(ns):
    """B looked A's pages up; A then reuses those slots for other pages. B's read must miss, not
    return A's new bytes as the old pages."""
    ha, hb = make_host_pool("page_first", seed=49), make_host_pool("page_first", seed=50)
    a = attach(ha, {**ns, "node_id": "a", "partition": 0, "interface_v1": 1})
    b = attach(hb, {**ns, "node_id": "b", "partition": 1, "interface_v1": 1})
    keys, newer = chain_keys(4, "stale"), chain_keys(4, "newer")
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert all(a.batch_set_v1(keys, slots(0, 4), info))
    fmt = a._format("kv")
    old_slots = {a.store.location(k).slot for k in a.keys.chain(keys, None, fmt, "v1").keys}
    assert b.batch_exists(keys, info) == 4  # B now remembers where A's pages are
    a.clear()
    assert all(a.batch_set_v1(newer, slots(4, 4), info))
    assert {a.store.location(k).slot for k in a.keys.chain(newer, None, fmt, "v1").keys} == old_slots
    assert b.batch_get_v1(keys, slots(8, 4), info) == [False] * 4
    assert b.radixtier_stats()["pages_remote"] == 0
    a.close()
    b.close()


@pytest.mark.parametrize("ci, fails", [("true", True), ("", False)])
def test_broken_sglang_install_fails_in_ci(tmp_path, ci, fails):
    """This module skips itself without sglang, except under CI=true, where it must fail."""
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('broken sglang install (test)')\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__,
                           "-k", "test_rank_identity_counts_dp"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = proc.stdout + proc.stderr
    assert "broken sglang install" in out
    if fails:
        assert proc.returncode != 0 and "CI=true" in out
    else:
        assert proc.returncode in (0, 5) and "skipped" in out  # 5: nothing left to run


@pytest.mark.parametrize("redis_kind", ["plain", "cluster"])
def test_cross_node_continuation_prefetch_whatever_prefix_keys_sglang_passes(ns, tmp_path, redis_kind):
    """SGLang's prefetch passes the anchor node's ancestors as prefix keys (None in batch_exists and
    [] in batch_get_v1 when the anchor hangs under the root): node B must still find node A's turns."""
    from radixtier.testing.redis_server import RedisServer, start_cluster

    if redis_kind == "cluster":
        servers = start_cluster(str(tmp_path / "cluster"))
        url, cluster = f"redis://127.0.0.1:{servers[0].port}/0", True
    else:
        servers = [RedisServer(str(tmp_path / "redis"))]
        url, cluster = servers[0].url, False
    try:
        host_a, host_b = make_host_pool("page_first", seed=31), make_host_pool("page_first", seed=32)
        common = {"path": ns["path"], "capacity": ns["capacity"], "redis_url": url, "redis_cluster": cluster,
                  "interface_v1": 1}
        a = attach(host_a, {**common, "node_id": "node-a", "partition": 0})
        b = attach(host_b, {**common, "node_id": "node-b", "partition": 1})
        keys = chain_keys(12, f"multi-turn-{redis_kind}")
        t1, t2, t3 = keys[:4], keys[4:8], keys[8:]
        # backups carry contiguous prefix keys (SGLang's write path)
        assert all(a.batch_set_v1(t1, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])))
        assert all(a.batch_set_v1(t2, slots(4, 4), HiCacheStorageExtraInfo(prefix_keys=t1)))
        assert all(a.batch_set_v1(t3, slots(8, 4), HiCacheStorageExtraInfo(prefix_keys=t1 + t2)))
        assert a.flush(10)
        # prefetch shapes (SGLang's read path): anchor = turn 1's node, directly under the root
        assert b.batch_exists(t2, None) == 4
        assert b.batch_exists(t2, HiCacheStorageExtraInfo(prefix_keys=None)) == 4
        assert all(b.batch_get_v1(t2, slots(20, 4), HiCacheStorageExtraInfo(prefix_keys=[])))
        # anchor = turn 2's node: prefix keys are its ancestors (turn 1) only, turn 2 left out
        assert b.batch_exists(t3, HiCacheStorageExtraInfo(prefix_keys=t1)) == 4
        assert all(b.batch_get_v1(t3, slots(24, 4), HiCacheStorageExtraInfo(prefix_keys=t1)))
        # the full chain and a fresh sequence still work
        assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 12
        assert all(b.batch_get_v1(t1, slots(28, 4), None))
        got = [page_bytes(host_b, p) for p in list(range(28, 32)) + list(range(20, 28))]
        assert got == [page_bytes(host_a, p) for p in range(12)]
        assert b.radixtier_stats()["pages_remote"] == 12
        a.close()
        b.close()
    finally:
        for s in servers:
            s.stop()
