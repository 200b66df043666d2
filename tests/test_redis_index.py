"""The Redis prefix index against real redis-server processes (started, killed and restarted here)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis

from radixtier.storage.index.records import encode_record
import torch

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace, PageHasher
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex
from radixtier.tiers import Tier

from radixtier.testing.pages import page_content
from radixtier.testing.index import NS_UUID, index, rec, wait_for
from radixtier.testing.redis_server import RedisServer, free_port, start_cluster


def k(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


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
    """Entries that do not make sense (version, tier, generation, length) are rejected by the
    client and counted, never used; a value that is not whole entries ends the run there."""
    import struct

    from radixtier.storage.index.records import node_field

    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = [k(i) for i in range(3)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(3)])
    assert a.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 3)
    raw = redis.Redis.from_url(redis_server.url)
    page1 = a._keys.page(keys[0], keys[1])
    good = encode_record(rec("node-a", 1))
    for bad in (b"\x09" + good[1:],  # unknown version
                good[:1] + b"\x07" + good[2:],  # unknown tier
                good[:28] + struct.pack("<Q", 0) + good[36:],  # generation 0
                good[:36] + struct.pack("<I", 0) + good[40:]):  # length 0
        before = b.counters["rejected_records"]
        raw.set(page1, node_field("node-a") + bad)
        assert len(b.lookup(keys[0], keys)) == 1  # the run stops at the bad page
        assert len(b.lookup_locations(keys[0], keys, NS_UUID)) == 1
        assert b.counters["rejected_records"] > before
    raw.set(page1, b"\xc1 not entries")
    assert len(b.lookup(keys[0], keys)) == 1
    raw.set(page1, node_field("node-a") + good)
    assert len(b.lookup(keys[0], keys)) == 3
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
    ("write_timeout_s", -1, "write_timeout_s"),
    ("lookup_timeout_s", float("nan"), "lookup_timeout_s"),
    ("heartbeat_s", float("inf"), "heartbeat_s"),
    ("write_timeout_s", float("nan"), "write_timeout_s"),
    ("node_ttl_s", 0.1, "node_ttl_s"),
    ("namespace", "x{y}", "namespace"),
])
def test_bad_index_configuration_is_named(field, value, msg):
    cfg = RedisIndexConfig(heartbeat_s=0.2)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=msg):
        RedisPrefixIndex(cfg)


@pytest.mark.parametrize("url", ["unix:///tmp/redis.sock", "redis://127.0.0.1:1/3", "redis://127.0.0.1:1/0?db=2"])
def test_cluster_configuration_errors_are_not_mistaken_for_unreachable(url):
    with pytest.raises(ValueError, match="redis_url"):
        RedisPrefixIndex(RedisIndexConfig(url=url, cluster=True, heartbeat_s=0.2))


def test_counters_are_exact_under_concurrent_lookups():
    a = index(f"redis://127.0.0.1:{free_port()}/0", "node-a")  # nothing listens: every lookup fails fast
    def hammer():
        for _ in range(5000):
            a.lookup(k(0), [k(0)])

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    h = a.health()
    assert h["lookups"] == h["lookup_failures"] == 40000
    a.close()


NODE_A = textwrap.dedent("""
    import sys, time, torch
    from radixtier.testing.pages import page_content
    from radixtier.cache import CacheConfig, TieredKVCache
    from radixtier.hashing import KVNamespace, PageHasher
    from radixtier.storage.nvmeof.store import NvmeofPageStore
    from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex
    ns = KVNamespace("m", "int32", "flat", 4)
    store = NvmeofPageStore({path!r}, 4096, partition=0, node_id="node-a")
    idx = RedisPrefixIndex(RedisIndexConfig(url={url!r}, node_id="node-a", namespace=ns.tag(), heartbeat_s=0.2,
                                            node_ttl_s=1.0, gc_interval_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.5))
    cache = TieredKVCache(CacheConfig(page_size=4, page_shape=(1024,), dtype=torch.int32, device="cpu"), ns,
                          store=store, index=idx)
    tokens = list(range(1000, 1064))
    keys = PageHasher(ns).chain(tokens)
    cache.insert(tokens, torch.stack([page_content(key, 1024) for key in keys]))
    other = list(range(2000, 2016))  # B never reads these: only A's records can make them remote hits
    cache.insert(other, torch.stack([page_content(key, 1024) for key in PageHasher(ns).chain(other)]))
    cache.flush()
    idx.flush()
    print("ready", flush=True)
    sys.stdin.read()  # serve until the test closes stdin (or kills us)
""")


def test_two_nodes_share_pages_through_namespace_and_index(tmp_path, redis_server):
    path = str(tmp_path / "shared.img")
    format_namespace(path, 4096, capacity_bytes=16 << 20, partitions=2)
    node_a = subprocess.Popen([sys.executable, "-c", NODE_A.format(path=path, url=redis_server.url)],
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
        # a dead node's records stop being served: pages B never read are remote hits only while A lives
        other = list(range(2000, 2016))
        fresh = TieredKVCache(CacheConfig(page_size=4, page_shape=(1024,), dtype=torch.int32, device="cpu"), ns,
                              store=store, index=idx)
        assert wait_for(lambda: fresh.match(other).remote_tokens == 16)
        node_a.kill()
        node_a.wait()
        assert wait_for(lambda: fresh.match(other).remote_tokens == 0, timeout=5)
        # GC may have removed A's records first; it counts them after its last Redis call of the pass
        assert wait_for(lambda: idx.counters["dead_records_ignored"] + idx.counters["gc_removed"] > 0, timeout=5)
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
    servers = start_cluster(str(tmp_path))
    try:
        url = f"redis://127.0.0.1:{servers[0].port}/0"
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
        c = index(url, "node-c", cluster=True, lookup_timeout_s=0.1)
        ch = chains[0]
        shard = next(s for s in servers if redis.Redis(port=s.port).keys(f"radixtier:test:{{{ch[0].hex()}}}:p:*"))
        assert wait_for(lambda: len(c.lookup(ch[0], ch)) == 8)
        with shard.paused():  # one shard stalls: redis-py's own retries (each a timeout) must not run
            t = time.monotonic()
            assert c.lookup(ch[0], ch) == []
            took = time.monotonic() - t
        assert took < max(0.5, 5 * c.config.lookup_timeout_s), f"lookup took {took:.3f} s"
        a.close(), b.close(), c.close()
    finally:
        for s in servers:
            s.stop()


def test_lookups_find_a_chain_again_after_its_master_fails_over(tmp_path):
    """The packed MGET picks the node from the client's slot map; a dead master must send the
    lookup through redis-py's mget, which asks for the refresh that finds the promoted replica."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    servers = start_cluster(str(tmp_path), nodes=3, replicas=1)
    try:
        url = f"redis://127.0.0.1:{servers[0].port}/0"
        # Liveness outlasts the failover (longer than the 5 s default, for a loaded CI machine): with a 1 s TTL a slow
        # election made node-a look dead, its records were collected, and nothing was left to find.
        live = dict(cluster=True, lookup_timeout_s=0.5, node_ttl_s=30.0, gc_interval_s=60.0)
        a = index(url, "node-a", **live)
        b = index(url, "node-b", **live)
        ch = [k(7000 + i) for i in range(8)]
        a.publish(ch[0], ch, [rec("node-a", i) for i in range(8)])
        assert a.flush()
        assert wait_for(lambda: len(b.lookup(ch[0], ch)) == 8)
        master = next(s for s in servers[:3] if redis.Redis(port=s.port).keys(f"radixtier:test:{{{ch[0].hex()}}}:p:*"))
        assert redis.Redis(port=master.port).execute_command("WAIT", 1, 5000) == 1  # the replica has the chain
        master.kill()
        t = time.monotonic()
        assert wait_for(lambda: len(b.lookup(ch[0], ch)) == 8, timeout=30), \
            f"the chain was not found after failover: reader {b.counters}, writer {a.health()}"
        print(f"found again {time.monotonic() - t:.1f} s after the master died")
        a.close(), b.close()
    finally:
        for s in servers:
            s.stop()


def test_a_failing_batch_is_retried_not_lost(redis_server):
    """A server error that is not a lost connection (a cluster mid-election) must not drop updates."""
    a = index(redis_server.url, "node-a")
    b = index(redis_server.url, "node-b")
    real, failures = a._publisher.apply_batch, [3]

    def flaky(ops):
        if failures[0]:
            failures[0] -= 1
            raise redis.ResponseError("CLUSTERDOWN The cluster is down")
        return real(ops)

    a._publisher.apply_batch = flaky
    keys = [k(900 + i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(10)
    assert failures[0] == 0 and a.counters["dropped_ops"] == 0
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    a.close(), b.close()


def _raw_keys(url: str, node: str) -> tuple:
    raw = redis.Redis.from_url(url)
    return raw, f"radixtier:test:{{o:{node}}}"


def test_publish_then_unpublish_in_one_batch_leaves_nothing(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    key = k(500)
    a._publisher.apply_batch([("pub", (key, key, rec("node-a", 1))), ("unpub", (key,))])  # one drained batch
    raw, owned = _raw_keys(redis_server.url, "node-a")
    assert not raw.exists(a._keys.page(key, key))  # nothing published remains
    assert not raw.exists(a._keys.root_ptr(key)) and raw.hlen(owned) == 0
    a._publisher.apply_batch([("pub", (key, key, rec("node-a", 1))), ("unpub", (key,)),
                              ("pub", (key, key, rec("node-a", 2)))])
    assert [r[0].location.slot for r in b.lookup(key, [key])] == [2]
    assert raw.hget(owned, key.hex()) == key.hex().encode()
    b.close()
    a.close()


def test_restart_removes_records_of_pages_no_longer_held(redis_server):
    """Unpublishes dropped from a full queue (or lost in a crash) must not outlive a re-publication."""
    keys = [k(600 + i) for i in range(6)]
    a = index(redis_server.url, "node-a")
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(6)])
    assert a.flush()
    a._stop.set()  # crash: the store evicts pages 3..5, but their unpublish never reaches Redis
    a._worker.join()
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 6)
    held = [(keys[0], keys[i], rec("node-a", i)) for i in range(3)]
    a2 = index(redis_server.url, "node-a")  # the restart re-publishes what the store recovered
    a2.set_republisher(lambda: iter(held))
    assert wait_for(lambda: a2.counters["stale_removed"] == 3)
    assert a2.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 3)
    raw, owned = _raw_keys(redis_server.url, "node-a")
    assert sorted(raw.hkeys(owned)) == sorted(key.hex().encode() for key in keys[:3])
    a2.close(), b.close()


def test_republish_keeps_the_root_a_page_was_published_under(redis_server):
    """A trailing sidecar window is published under its sequence's first page, a root the store's
    parent links cannot show: a restart must not move (or delete) those records."""
    seq_root, window = k(650), [k(651 + i) for i in range(3)]
    a = index(redis_server.url, "node-a")
    a.publish(seq_root, window, [rec("node-a", i) for i in range(3)])
    assert a.flush()
    a._stop.set()
    a._worker.join()
    a2 = index(redis_server.url, "node-a")
    a2.set_republisher(lambda: iter([(window[0], key, rec("node-a", i)) for i, key in enumerate(window)]))
    assert wait_for(lambda: a2.counters["republished"] == 3)
    assert a2.flush()
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: len(b.lookup(seq_root, window)) == 3)  # still found where lookups ask
    assert a2.counters["stale_removed"] == 0
    a2.close(), b.close()


@pytest.mark.parametrize("reply", ["CLUSTERDOWN The cluster is down", "READONLY You can't write against a read "
                                   "only replica.", "BUSY Redis is busy running a script.", "OOM command not allowed "
                                   "when used memory > 'maxmemory'.", "LOADING Redis is loading the dataset in memory",
                                   "MASTERDOWN Link with MASTER is down", "TRYAGAIN Multiple keys request during "
                                   "rehashing of slot"])
def test_server_errors_during_lookup_mean_redis_is_down(redis_server, reply):
    from redis._parsers.base import BaseParser

    b = index(redis_server.url, "node-b", backoff_initial_s=0.3)
    keys = [k(700 + i) for i in range(2)]
    b.publish(keys[0], keys, [rec("node-b", i) for i in range(2)])
    assert b.flush()
    real, calls = b._lookups.fetch_values, [0]

    def failing(*_args):
        calls[0] += 1
        raise BaseParser.parse_error(reply)  # exactly what redis-py raises for that server reply

    b._lookups.fetch_values = failing
    assert b.lookup(keys[0], keys, exclude_self=False) == []  # no exception reaches the caller
    assert not b.up and b.counters["lookup_failures"] == 1
    assert b.lookup(keys[0], keys, exclude_self=False) == [] and calls[0] == 1  # backing off: Redis not asked
    b._lookups.fetch_values = real
    assert wait_for(lambda: len(b.lookup(keys[0], keys, exclude_self=False)) == 2)
    assert b.up
    b.close()


def test_busy_script_on_the_server_is_down_not_an_exception(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("busy-reply-threshold", 50)
    b = index(redis_server.url, "node-b")
    keys = [k(750 + i) for i in range(2)]
    b.publish(keys[0], keys, [rec("node-b", i) for i in range(2)])
    assert b.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys, exclude_self=False)) == 2)
    hog = threading.Thread(target=lambda: pytest.raises(redis.ResponseError, redis.Redis.from_url(
        redis_server.url).eval, "while true do end", 0), daemon=True)
    hog.start()
    try:
        time.sleep(0.2)  # past the busy threshold: every other client now gets BUSY
        assert b.lookup(keys[0], keys, exclude_self=False) == []
        assert not b.up
    finally:
        assert wait_for(lambda: _script_kill(redis_server.url))
        hog.join(5)
    assert wait_for(lambda: len(b.lookup(keys[0], keys, exclude_self=False)) == 2)
    b.close()


def _script_kill(url: str) -> bool:
    try:
        redis.Redis.from_url(url).script_kill()
        return True
    except redis.ResponseError:
        return False


def test_slow_redis_lookups_answer_nothing_remote_fast_and_recover(redis_server):
    a = index(redis_server.url, "node-a")
    b = index(redis_server.url, "node-b", lookup_timeout_s=0.05)
    keys = [k(800 + i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    bound = max(0.5, 5 * b.config.lookup_timeout_s)
    worst = 0.0
    with redis_server.paused():  # SIGSTOP: connections are accepted, nothing is answered
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            t = time.monotonic()
            assert b.lookup(keys[0], keys) == []
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.01)
        assert not b.up
    assert worst < bound, f"a lookup took {worst:.3f} s against a stalled Redis"
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4, timeout=15)
    assert b.up
    a.close(), b.close()


def test_slow_write_batches_do_not_switch_lookups_off(redis_server):
    # a's backoff is long: had a write stall marked a down, its lookups would answer [] for 2 s
    a = index(redis_server.url, "node-a", backoff_initial_s=2.0, backoff_max_s=5.0)
    b = index(redis_server.url, "node-b")
    keys = [k(850 + i) for i in range(4)]
    b.publish(keys[0], keys, [rec("node-b", i) for i in range(4)])
    assert b.flush()
    assert wait_for(lambda: len(a.lookup(keys[0], keys)) == 4)
    with redis_server.paused():
        time.sleep(0.4)  # 8x the lookup timeout: a's heartbeat (every 0.2 s) waits through it
    assert wait_for(lambda: len(a.lookup(keys[0], keys)) == 4, timeout=1.0)
    assert a.health()["writer_up"] and a.up
    a.close(), b.close()


def test_cluster_unreachable_at_start_is_degraded_and_lookups_stay_fast(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port(cluster=True)
    url = f"redis://127.0.0.1:{port}/0"
    a = index(url, "node-a", cluster=True)  # nothing listens yet: must not raise
    bound = max(0.5, 5 * a.config.lookup_timeout_s)
    t = time.monotonic()
    assert a.lookup(k(0), [k(0)]) == [] and not a.up
    assert time.monotonic() - t < bound
    d = str(tmp_path / "c")
    srv = RedisServer(d, port=port, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                           os.path.join(d, "nodes.conf")])
    try:
        raw = redis.Redis(port=port)
        raw.execute_command("CLUSTER ADDSLOTS", *range(16384))  # a one-shard cluster
        assert wait_for(lambda: raw.execute_command("CLUSTER INFO")["cluster_state"] == "ok")
        keys = [k(950 + i) for i in range(3)]
        a.publish(keys[0], keys, [rec("node-a", i) for i in range(3)])
        assert wait_for(lambda: len(a.lookup(keys[0], keys, exclude_self=False)) == 3, timeout=15)
        with srv.paused():  # the shard stalls: no redis-py retries (each a timeout), no backoff sleeps
            for _ in range(10):
                t = time.monotonic()
                assert a.lookup(keys[0], keys, exclude_self=False) == []
                assert time.monotonic() - t < bound
                time.sleep(0.05)
        assert wait_for(lambda: len(a.lookup(keys[0], keys, exclude_self=False)) == 3, timeout=15)
    finally:
        srv.stop()
        a.close()


@pytest.mark.parametrize("later_holder_first_seen_on_page", [1, 3])
def test_chain_decoding_finds_holders_that_the_first_page_does_not_have(later_holder_first_seen_on_page):
    """Pages mostly share their holders, and the decoder bets on the first page's: a holder seen
    only later must still be told apart (its own liveness, the caller's own entries skipped)."""
    from radixtier.storage.index.records import PageHolders, encode_record, node_field

    def entry(node, slot):
        return node_field(node) + encode_record(rec(node, slot))

    late = later_holder_first_seen_on_page
    values = []
    for page in range(5):
        holders = ["a", "me"] if page < late else ["late", "a", "me"]
        values.append(b"".join(entry(n, 100 * page + i) for i, n in enumerate(holders)))

    def slots(dead=()):
        chain = PageHolders(values, exclude="me")
        assert sorted(chain.nodes) == ["a", "late", "me"]
        chain.keep_nodes([n not in dead for n in chain.nodes])
        return [loc[1] for loc in chain.locations(NS_UUID)]

    assert slots() == [100 * p for p in range(5)]  # each page's first holder: "a", then "late"
    assert slots(dead=["late"]) == [100 * p + (p >= late) for p in range(5)]  # "a" serves every page
    assert slots(dead=["a"]) == []  # page 0 has no live holder but the caller itself


@pytest.mark.parametrize("values", [[], [None], [None, b"x" * 96], [b""], [b"", b"x" * 96]])
def test_a_chain_with_no_entries_is_a_plain_miss(values):
    """A chain whose first page is absent (the commonest lookup of all) is a miss, not a failure."""
    from radixtier.storage.index.records import PageHolders

    chain = PageHolders(values, exclude="me")
    assert (chain.pages, chain.nodes, chain.rejected) == (0, [], 0)
    assert chain.keep_nodes([]) == 0
    assert chain.run_length() == 0 and chain.locations(NS_UUID) == [] and chain.records(4) == []


def test_lookups_of_chains_nobody_published_count_no_failures(redis_server):
    a = index(redis_server.url, "node-a")
    keys = [k(i) for i in range(8)]
    assert a.lookup(keys[0], keys) == []
    assert a.health()["lookup_failures"] == 0
    a.close()
