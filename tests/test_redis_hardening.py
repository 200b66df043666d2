"""The prefix index under hostile data and wrong credentials (real redis-server processes)."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from radixtier.storage.index.records import encode_record
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

from radixtier.testing.redis_server import RedisServer
from radixtier.testing.index import chain_key as k, index, publish_chain, rec, wait_for


@pytest.fixture
def acl_server(tmp_path):
    srv = RedisServer(str(tmp_path / "acl"), extra=[
        "--user", "default", "on", "nopass", "~*", "&*", "+@all",
        "--user", "pinger", "on", ">pw", "~*", "+ping",
        "--user", "elsewhere", "on", ">pw", "~other:*", "+@all",
        "--user", "radix", "on", ">pw", "~*", "&*", "+@all"])
    yield srv
    srv.stop()


@pytest.mark.parametrize("user", ["pinger", "elsewhere"])
def test_a_user_without_the_needed_rights_is_refused_at_start(acl_server, user):
    with pytest.raises(ValueError, match=rf"redis_username: user '{user}' lacks permission for SET .*radixtier:test"):
        index(acl_server.url, "node-a", username=user, password="pw")


def test_rights_lost_at_run_time_show_in_health_without_log_spam(acl_server, caplog):
    a = index(acl_server.url, "node-a", username="radix", password="pw")
    publish_chain(a, 0, 2)
    assert a.health()["writer_up"] and not a.health()["access_denied"]
    admin = redis.Redis.from_url(acl_server.url)
    admin.acl_setuser("radix", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-@write", "-@scripting"], reset_keys=True, reset_channels=True)
    caplog.set_level(logging.WARNING, logger="radixtier.storage.redis")
    a.publish(k(50), [k(50)], [rec("node-a", 50)])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not a.health()["access_denied"]:
        time.sleep(0.05)
    h = a.health()
    assert h["access_denied"] and "permission" in h["access_denied"] and not h["writer_up"]
    time.sleep(1.0)
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 4  # was ~17 a second
    admin.acl_setuser("radix", enabled=True, commands=["+@all"])  # rights back: health recovers
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and a.health()["access_denied"]:
        time.sleep(0.05)
    assert not a.health()["access_denied"] and a.flush(timeout=5)
    a.close()


@pytest.mark.parametrize("field, value", [("ssl_ca_certs", "/etc/ssl/ca.pem"), ("ssl_certfile", "c.pem"),
                                          ("ssl_keyfile", "k.pem"), ("ssl_cert_reqs", "none")])
def test_tls_options_on_a_plaintext_url_are_refused(field, value):
    cfg = RedisIndexConfig(url="redis://127.0.0.1:1/0", heartbeat_s=0.2)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=rf"^{field}: .*redis_url 'redis://127.0.0.1:1/0' is not rediss://"):
        RedisPrefixIndex(cfg)


def test_an_oversized_value_does_not_switch_lookups_off(redis_server):
    """A 64 MiB value on one page costs that chain's lookups (its run ends there, or the lookup
    times out on it); other chains keep being answered and Redis stays up for everyone."""
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    bad = publish_chain(a, 0, 4)
    good = publish_chain(a, 100, 4)
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(b._keys.page(bad[0], bad[1]), b"\0" * (64 << 20))  # 64 MiB in one page's value
    for _ in range(5):
        assert len(b.lookup(bad[0], bad)) <= 1  # never a record from the oversized value
        # answered (a stall of a loaded machine may cost one try its 50 ms budget: that is a chain
        # failure, counted below, never the link going down)
        assert wait_for(lambda: len(b.lookup(good[0], good)) == 4, timeout=5)
    health = b.health()
    assert b.up and health["lookup_failures"] == health["chain_failures"]  # no failure took the link down
    a.close()
    b.close()


def test_a_page_held_by_many_nodes_returns_a_bounded_sample(redis_server):
    b = index(redis_server.url, "node-b", lookup_timeout_s=0.5)
    raw = redis.Redis.from_url(redis_server.url)
    keys = [k(1000 + i) for i in range(512)]
    holders = [f"n{j}" for j in range(64)]
    from radixtier.storage.index.records import node_field

    pipe = raw.pipeline(transaction=False)
    for node in holders:
        pipe.set(b._keys.node(node), "alive", px=60_000)
        pipe.sadd(f"{b._keys.prefix}:{{nodes}}:all", node)
    for i, key in enumerate(keys):  # 64 holders per page: written directly (writers keep at most 16)
        pipe.set(b._keys.page(keys[0], key), b"".join(node_field(node) + encode_record(rec(node, i * 64 + j))
                                                     for j, node in enumerate(holders)))
    pipe.execute()
    seen = set()
    for _ in range(3):
        run = b.lookup(keys[0], keys)
        assert len(run) == 512
        assert all(1 <= len(recs) <= b.config.lookup_max_holders for recs in run)
        seen |= {r.node_id for recs in run for r in recs}
    assert len(seen) > b.config.lookup_max_holders  # a random sample, not a fixed few
    assert len(b.lookup_locations(keys[0], keys, run[0][0].location.namespace)) == 512
    b.close()


def test_a_node_set_full_of_junk_ids_does_not_stall_lookups_or_gc(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = publish_chain(a, 0, 8)
    raw = redis.Redis.from_url(redis_server.url)
    all_key = f"{b._keys.prefix}:{{nodes}}:all"
    for start in range(0, 300_000, 10_000):
        raw.sadd(all_key, *[f"fake{i}" for i in range(start, start + 10_000)])
    for _ in range(20):
        assert len(b.lookup(keys[0], keys)) == 8
    assert b.up and b.health()["lookup_failures"] == 0
    t0 = time.monotonic()
    b.collect_garbage()  # one pass handles a bounded slice of the set
    assert time.monotonic() - t0 < 10
    assert raw.scard(all_key) < 300_000 and raw.sismember(all_key, "node-a")
    a.close()
    b.close()


def test_root_pointers_of_pages_nobody_holds_are_deleted(redis_server):
    a, b = index(redis_server.url, "node-a"), index(redis_server.url, "node-b")
    keys = publish_chain(a, 0, 4)
    raw = redis.Redis.from_url(redis_server.url)
    assert all(raw.exists(a._keys.root_ptr(k)) for k in keys)
    assert len(b.lookup(None, keys[1:])) == 3  # no prefix keys: the root comes from the pointer
    b.publish(keys[0], keys[:1], [rec("node-b", 0)])  # node B holds page 0 too
    assert b.flush()
    a.unpublish(keys)
    assert a.flush()
    assert raw.exists(a._keys.root_ptr(keys[0]))  # still held by B: its pointer stays
    assert not any(raw.exists(a._keys.root_ptr(k)) for k in keys[1:])
    a.close()
    b.close()
