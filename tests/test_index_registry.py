"""Registry data is untrusted: a key of the wrong type or an undecodable node id is reported,
repaired or skipped, and never stalls publishing or dead-node cleanup (real redis-server)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis

from radixtier.testing.index import chain_key as k, index, publish_chain, rec, wait_for


def _problems(ix) -> str:
    return " | ".join(ix.health()["registry_problems"])


def _keep_setting(stop: threading.Event, fn) -> threading.Thread:
    """A hostile writer: `fn` again every 50 ms until `stop`."""
    def run() -> None:
        while not stop.is_set():
            fn()
            stop.wait(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("name, kind", [("all", b"set"), ("beats", b"hash")])
def test_a_wrong_type_node_registry_never_stalls_publishing(redis_server, caplog, name, kind):
    raw = redis.Redis.from_url(redis_server.url)
    a = index(redis_server.url, "node-a")
    key = f"{a._keys.prefix}:{{nodes}}:{name}"
    caplog.set_level(logging.WARNING, logger="radixtier.storage.redis")
    stop = threading.Event()
    junk = _keep_setting(stop, lambda: raw.set(key, "junk"))
    try:
        b = index(redis_server.url, "node-b")  # starts with the junk there too
        time.sleep(0.5)  # a few heartbeats meet it before anything is published
        keys = [k(300 + i) for i in range(4)]
        a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
        assert a.flush(5), a.health()
        assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
        assert wait_for(lambda: key in _problems(a))
        time.sleep(1.0)
    finally:
        stop.set()
        junk.join()
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 4, noisy  # one line per distinct problem per minute, not ~40 a second
    assert a.health()["writer_up"]
    assert wait_for(lambda: raw.type(key) == kind)  # repaired by the next heartbeat
    assert wait_for(lambda: raw.sismember(f"{a._keys.prefix}:{{nodes}}:all", "node-a") if name == "all" else
                    raw.hexists(key, "node-a"))
    a.close(), b.close()


def test_a_wrong_type_heartbeat_key_is_replaced(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = publish_chain(a, 0, 4)
    beat = a._keys.node("node-a")
    raw.delete(beat)
    raw.hset(beat, "x", "1")  # node-a would look dead to everyone
    assert wait_for(lambda: raw.type(beat) == b"string")
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    assert beat in _problems(a)
    raw.hset(a._keys.node("node-c"), "x", "1")  # a junk heartbeat key is not a live node: no wait, no refusal
    t = time.monotonic()
    c = index(redis_server.url, "node-c")
    assert time.monotonic() - t < 0.5 and raw.type(c._keys.node("node-c")) == b"string"
    a.close(), b.close(), c.close()


def test_a_wrong_type_owned_pages_hash_is_rebuilt(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    owned = a._keys.owned("node-a")
    raw.set(owned, "junk")
    keys = [k(310 + i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(5), a.health()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    assert raw.type(owned) == b"hash" and raw.hlen(owned) == 4  # what unpublish and GC need
    assert owned in _problems(a)
    a.unpublish(keys)
    assert a.flush(5) and wait_for(lambda: b.lookup(keys[0], keys) == [])
    a.close(), b.close()


def test_a_wrong_type_page_value_costs_that_page_only(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = [k(320 + i) for i in range(4)]
    raw.hset(a._keys.page(keys[0], keys[2]), "x", "1")  # page 2 of the chain is a hash
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(5), a.health()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)  # replaced by node-a's entry; the others published
    assert a.counters["dropped_ops"] == 0
    raw.delete(a._keys.page(keys[0], keys[1]))
    raw.hset(a._keys.page(keys[0], keys[1]), "x", "1")
    a.unpublish(keys)
    assert a.flush(5)
    assert not raw.exists(*[a._keys.page(keys[0], key) for key in keys])
    a.close(), b.close()


@pytest.mark.parametrize("junk", ["string", "hash"])
def test_a_stuck_gc_lock_does_not_stop_collection(redis_server, junk):
    raw = redis.Redis.from_url(redis_server.url)
    d = index(redis_server.url, "node-d")
    keys = publish_chain(d, 0, 4)
    lock = f"{d._keys.prefix}:{{nodes}}:gc"
    if junk == "string":
        raw.set(lock, "someone")  # no TTL: never released
    else:
        raw.hset(lock, "x", "1")
    d._stop.set()  # node-d dies with its records in place
    d._worker.join()
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: not raw.exists(b._keys.page(keys[0], keys[0])), timeout=10)
    assert lock in _problems(b)
    b.close()


def test_an_undecodable_node_id_does_not_stop_dead_node_cleanup(redis_server):
    raw = redis.Redis.from_url(redis_server.url)
    d = index(redis_server.url, "node-d")
    keys = publish_chain(d, 0, 4)
    all_key = f"{d._keys.prefix}:{{nodes}}:all"
    bad = b"\xff\xfe-junk"
    junk_owned = f"{d._keys.prefix}:{{o:".encode() + bad + b"}"
    raw.sadd(all_key, bad)
    raw.hset(f"{d._keys.prefix}:{{nodes}}:beats", bad, "1")
    raw.hset(junk_owned, "ab" * 16, "cd" * 16)
    d._stop.set()
    d._worker.join()
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: not raw.exists(b._keys.page(keys[0], keys[0])), timeout=10)
    assert wait_for(lambda: not raw.sismember(all_key, bad) and not raw.exists(junk_owned))
    assert "not UTF-8" in _problems(b)
    b.close()


def test_a_failing_heartbeat_never_stops_publishing_and_is_said_once(redis_server, caplog):
    """Whatever fails the heartbeat (here: an error of its own), publishing and GC go on, and
    the error is one log line a minute, in health(), not one per loop."""
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    caplog.set_level(logging.WARNING, logger="radixtier.storage.redis")

    def broken() -> None:
        raise RuntimeError("heartbeat broke")

    a._beats.beat = broken
    time.sleep(0.5)
    keys = [k(330 + i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(5), a.health()
    raw = redis.Redis.from_url(redis_server.url)
    assert all(raw.exists(a._keys.page(keys[0], key)) for key in keys)
    time.sleep(0.5)
    assert len([r for r in caplog.records if "heartbeat broke" in r.getMessage()]) == 1
    assert any("heartbeat broke" in e for e in a.health()["recent_errors"])
    b.close()
    a._stop.set()
