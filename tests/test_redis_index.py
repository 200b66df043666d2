"""The Redis prefix index against real redis-server processes (started, killed and restarted here)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import redis
import torch

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace, PageHasher
from radixtier.storage.nvmeof_store import NvmeofPageStore, format_namespace
from radixtier.storage.page_store import PageLocation
from radixtier.storage.prefix_index import PageRecord
from radixtier.storage.redis_index import RedisIndexConfig, RedisPrefixIndex
from radixtier.tiers import Tier

from conftest import page_content
from redis_server import RedisServer

NS_UUID = "ab" * 16


def k(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def rec(node: str, slot: int) -> PageRecord:
    return PageRecord(node, "storage", PageLocation(NS_UUID, slot, slot + 1, 4096, 7))


def index(url: str, node: str, **kw) -> RedisPrefixIndex:
    cfg = dict(url=url, node_id=node, namespace="test", heartbeat_s=0.2, node_ttl_s=1.0, gc_interval_s=0.5,
               backoff_initial_s=0.05, backoff_max_s=0.5)
    cfg.update(kw)
    return RedisPrefixIndex(RedisIndexConfig(**cfg))


def wait_for(cond, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def test_chain_lookup_returns_leading_run_in_one_round_trip(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = [k(i) for i in range(10)]
    a.publish(keys[0], keys[:6], [rec("node-a", i) for i in range(6)])
    a.publish(keys[0], keys[7:], [rec("node-a", i) for i in range(7, 10)])  # page 6 missing: the run stops there
    assert a.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 6)
    run = b.lookup(keys[0], keys)
    assert [r[0].location.slot for r in run] == list(range(6))
    assert a.lookup(keys[0], keys) == []  # its own pages are excluded by default
    assert len(a.lookup(keys[0], keys, exclude_self=False)) == 6
    # all keys of one chain share one cluster hash slot
    raw = redis.Redis.from_url(redis_server.url)
    names = [n.decode() for n in raw.keys("radixtier:test:{*}:p:*")]
    assert len(names) == 9 and len({n[n.index("{"):n.index("}") + 1] for n in names}) == 1
    from redis.crc import key_slot

    assert len({key_slot(n.encode()) for n in names}) == 1
    a.unpublish(keys[:3])
    assert a.flush()
    assert wait_for(lambda: b.lookup(keys[0], keys) == [])
    assert len(b.lookup(keys[0], keys[3:])) == 3
    a.close(), b.close()


def test_malformed_records_are_rejected(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = [k(i) for i in range(3)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(3)])
    assert a.flush()
    raw = redis.Redis.from_url(redis_server.url)
    page1 = f"radixtier:test:{{{keys[0].hex()}}}:p:{keys[1].hex()}"
    raw.hset(page1, "node-a", b"\xc1 not msgpack")
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 1)
    assert b.counters["rejected_records"] >= 1
    import msgpack

    bad = {"v": 1, "node": "node-a", "tier": "storage", "ns": "zz" * 16, "slot": 1, "gen": 1, "len": 1, "crc": 1}
    raw.hset(page1, "node-a", msgpack.packb(bad))
    assert len(b.lookup(keys[0], keys)) == 1
    forged = dict(bad, ns=NS_UUID, node="node-c")  # filed under node-a but claims node-c
    raw.hset(page1, "node-a", msgpack.packb(forged))
    assert len(b.lookup(keys[0], keys)) == 1
    a.close(), b.close()


def test_dead_node_records_stop_being_served_and_are_collected(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = [k(i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    a._stop.set()  # node A hangs: no more heartbeats (it does not say goodbye)
    a._worker.join()
    assert wait_for(lambda: b.lookup(keys[0], keys) == [], timeout=5)
    raw = redis.Redis.from_url(redis_server.url)
    assert wait_for(lambda: not raw.keys("radixtier:test:{*}:p:*"), timeout=5)  # garbage-collected by B
    assert b.counters["gc_removed"] == 4
    b.close()


def test_redis_down_is_fast_and_recovers_with_republish(redis_server):
    held = [(k(0), k(i), rec("node-a", i)) for i in range(5)]
    a = index(redis_server.url, "node-a", lookup_timeout_s=0.05)
    a.set_republisher(lambda: iter(held))
    b = index(redis_server.url, "node-b", lookup_timeout_s=0.05)
    keys = [k(i) for i in range(5)]
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 5)
    redis_server.kill()
    t = time.monotonic()
    for _ in range(20):
        assert b.lookup(keys[0], keys) == []  # no exception, no wait
    assert time.monotonic() - t < 1.0
    assert not b.up
    a.publish(keys[0], [k(99)], [rec("node-a", 99)])  # queued while down, never raises
    redis_server.start()  # a fresh, empty Redis on the same port
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 5, timeout=15), "records were not re-published"
    assert a.counters["reconnects"] >= 1 and a.counters["republished"] >= 10
    a.close(), b.close()


def test_acl_user_and_password(tmp_path):
    srv = RedisServer(str(tmp_path / "acl"), extra=["--user", "default", "off", "--user", "radix", "on", ">s3cret",
                                                     "~*", "&*", "+@all"])
    try:
        url = f"redis://127.0.0.1:{srv.port}/0"
        good = index(url, "node-a", username="radix", password="s3cret")
        good.publish(k(0), [k(0)], [rec("node-a", 0)])
        assert good.flush()
        good.close()
        with pytest.raises(ValueError, match="authentication failed|access refused"):
            index(url, "node-b", username="radix", password="wrong")
        with pytest.raises(ValueError, match="authentication failed|access refused"):
            index(f"redis://radix:nope@127.0.0.1:{srv.port}/0", "node-c")
    finally:
        srv.stop()


def _make_certs(d: str) -> dict:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    ca, ca_key = os.path.join(d, "ca.crt"), os.path.join(d, "ca.key")
    cert, key = os.path.join(d, "server.crt"), os.path.join(d, "server.key")
    run = lambda *a: subprocess.run(list(a), check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=radixtier-test-ca",
        "-keyout", ca_key, "-out", ca)
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key,
        "-out", os.path.join(d, "server.csr"))
    ext = os.path.join(d, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", os.path.join(d, "server.csr"), "-CA", ca, "-CAkey", ca_key,
        "-CAcreateserial", "-days", "1", "-out", cert, "-extfile", ext)
    return {"ca": ca, "cert": cert, "key": key}


def test_tls_rediss_url(tmp_path):
    certs = _make_certs(str(tmp_path))
    try:
        srv = RedisServer(str(tmp_path / "tls"), tls=certs)
    except RuntimeError as exc:
        if "tls" in str(exc).lower() or "Bad directive" in str(exc):
            pytest.skip(f"this redis-server was built without TLS: {exc}")
        raise
    try:
        assert srv.url.startswith("rediss://")
        a = index(srv.url, "node-a", ssl_ca_certs=certs["ca"], lookup_timeout_s=1.0, connect_timeout_s=1.0)
        b = index(srv.url, "node-b", ssl_ca_certs=certs["ca"], lookup_timeout_s=1.0, connect_timeout_s=1.0)
        a.publish(k(0), [k(0), k(1)], [rec("node-a", 0), rec("node-a", 1)])
        assert a.flush()
        assert wait_for(lambda: len(b.lookup(k(0), [k(0), k(1)])) == 2)
        a.close(), b.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("field, value, msg", [
    ("url", "http://x", "redis_url"),
    ("node_id", "a:b", "node_id"),
    ("lookup_timeout_s", 0, "lookup_timeout_s"),
    ("node_ttl_s", 0.1, "node_ttl_s"),
    ("namespace", "x{y}", "namespace"),
])
def test_bad_index_configuration_is_named(field, value, msg):
    cfg = RedisIndexConfig(heartbeat_s=0.2)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=msg):
        RedisPrefixIndex(cfg)


NODE_A = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from conftest import page_content
    from radixtier.cache import CacheConfig, TieredKVCache
    from radixtier.hashing import KVNamespace, PageHasher
    from radixtier.storage.nvmeof_store import NvmeofPageStore
    from radixtier.storage.redis_index import RedisIndexConfig, RedisPrefixIndex
    ns = KVNamespace("m", "int32", "flat", 4)
    store = NvmeofPageStore({path!r}, 4096, partition=0, node_id="node-a")
    idx = RedisPrefixIndex(RedisIndexConfig(url={url!r}, node_id="node-a", namespace=ns.tag(), heartbeat_s=0.2,
                                            node_ttl_s=1.0, gc_interval_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.5))
    cache = TieredKVCache(CacheConfig(page_size=4, page_shape=(1024,), dtype=torch.int32, device="cpu"), ns,
                          store=store, index=idx)
    tokens = list(range(1000, 1064))
    keys = PageHasher(ns).chain(tokens)
    cache.insert(tokens, torch.stack([page_content(key, 1024) for key in keys]))
    cache.flush()
    idx.flush()
    print("ready", flush=True)
    sys.stdin.read()  # serve until the test closes stdin (or kills us)
""")


def test_two_nodes_share_pages_through_namespace_and_index(tmp_path, redis_server):
    path = str(tmp_path / "shared.img")
    format_namespace(path, 4096, capacity_bytes=16 << 20, partitions=2)
    tests = os.path.dirname(__file__)
    node_a = subprocess.Popen([sys.executable, "-c", NODE_A.format(tests=tests, path=path, url=redis_server.url)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert node_a.stdout.readline().strip() == "ready"
        ns = KVNamespace("m", "int32", "flat", 4)
        store = NvmeofPageStore(path, 4096, partition=1, node_id="node-b")
        idx = index(redis_server.url, "node-b", namespace=ns.tag())
        cache = TieredKVCache(CacheConfig(page_size=4, page_shape=(1024,), dtype=torch.int32, device="cpu"), ns,
                              store=store, index=idx)
        tokens = list(range(1000, 1064)) + [7, 7, 7, 7]
        keys = PageHasher(ns).chain(tokens)
        assert wait_for(lambda: cache.match(tokens).remote_tokens == 64)
        with cache.acquire(tokens, policy="wait_complete") as h:
            assert h.result.num_pages == 16 and h.result.hits_by_tier == {Tier.REMOTE: 64}  # nothing recomputed
            got = cache.gather(h.result.device_slots)
            for i in range(16):
                assert torch.equal(got[i], page_content(keys[i], 1024)), f"page {i} differs"
        assert cache.match(tokens).device_tokens == 64  # now local
        other = list(range(2000, 2016))  # a dead node's records stop being served
        node_a.kill()
        node_a.wait()
        fresh = TieredKVCache(CacheConfig(page_size=4, page_shape=(1024,), dtype=torch.int32, device="cpu"), ns,
                              store=store, index=idx)
        assert wait_for(lambda: fresh.match(tokens).remote_tokens == 0, timeout=5)
        fresh.close()
        cache.close()
        idx.close()
        store.close()
    finally:
        if node_a.poll() is None:
            node_a.kill()


def test_redis_cluster_spreads_chains_and_keeps_each_lookup_in_one_slot(tmp_path):
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    servers = []
    try:
        for i in range(3):
            d = str(tmp_path / f"c{i}")
            servers.append(RedisServer(d, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                                 os.path.join(d, "nodes.conf")]))
        out = subprocess.run(["redis-cli", "--cluster", "create"] + [f"127.0.0.1:{s.port}" for s in servers]
                             + ["--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        url = f"redis://127.0.0.1:{servers[0].port}/0"
        assert wait_for(lambda: all(redis.Redis(port=s.port).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                                    for s in servers))
        a = index(url, "node-a", cluster=True, lookup_timeout_s=1.0)
        b = index(url, "node-b", cluster=True, lookup_timeout_s=1.0)
        chains = [[k(c * 100 + i) for i in range(8)] for c in range(12)]
        for ch in chains:
            a.publish(ch[0], ch, [rec("node-a", i) for i in range(8)])
        assert a.flush()
        for ch in chains:
            assert wait_for(lambda: len(b.lookup(ch[0], ch)) == 8)
        per_shard = [redis.Redis(port=s.port).dbsize() for s in servers]
        assert sum(1 for n in per_shard if n > 0) >= 2, per_shard  # chains spread over shards
        a.close(), b.close()
    finally:
        for s in servers:
            s.stop()


def test_a_failing_batch_is_retried_not_lost(redis_server):
    """A server error that is not a lost connection (a cluster mid-election) must not drop updates."""
    a = index(redis_server.url, "node-a")
    b = index(redis_server.url, "node-b")
    real, failures = a._apply, [3]

    def flaky(ops):
        if failures[0]:
            failures[0] -= 1
            raise redis.ResponseError("CLUSTERDOWN The cluster is down")
        return real(ops)

    a._apply = flaky
    keys = [k(900 + i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(10)
    assert failures[0] == 0 and a.counters["dropped_ops"] == 0
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    a.close(), b.close()
