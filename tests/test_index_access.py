"""What the start check proves: every command the index runs is probed before it serves (an ACL
user lacking any one is refused, naming it), publish failures show in health(), and a URL that
does not lead to Redis is a one-line error (real redis-server)."""

from __future__ import annotations

import time

import pytest
import redis

from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

from radixtier.testing.redis_server import RedisServer
from radixtier.testing.fake_servers import garbage_server, http_server
from radixtier.testing.index import chain_key as k, index, publish_chain, rec, wait_for

# Sent by the client library on connect, its refusal tolerated by it (the test below proves it: a
# user without them starts); or only this test's own, to read the stats.
_HANDSHAKE = {"client|setinfo", "hello"}
_THIS_TEST = {"config|resetstat", "info", "acl|setuser"}


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(str(tmp_path / "r"))
    yield srv
    srv.stop()


def _commands_a_node_runs(srv: RedisServer) -> set:
    """Every command (and subcommand) a node runs in its life: start, heartbeats, publish,
    unpublish, lookups, republication, collection of a dead node's records, close."""
    dead = index(srv.url, "node-dead")
    publish_chain(dead, 500, 3)
    dead._stop.set()  # crashes: its records wait for a collector
    dead._worker.join()
    time.sleep(dead.config.node_ttl_s + 0.2)
    admin = redis.Redis.from_url(srv.url)
    admin.script_flush()  # a restarted Redis forgets scripts: the node must load them again
    admin.config_resetstat()
    a = index(srv.url, "node-a")
    keys = publish_chain(a, 0, 4)
    a.set_republisher(lambda: iter([(keys[0], key, rec("node-a", i)) for i, key in enumerate(keys)]))
    assert wait_for(lambda: a.counters["republished"] >= 4)
    assert len(a.lookup(None, keys[1:], exclude_self=False)) == 3
    a.unpublish(keys[:2])
    assert a.flush()
    assert wait_for(lambda: a.counters["gc_removed"] >= 3)
    a.close()
    return {name[len("cmdstat_"):] for name in admin.info("commandstats")} - _THIS_TEST


def test_every_command_the_index_runs_is_probed_at_start(server):
    """An ACL user lacking any one command the index runs is refused at start, naming it; it used
    to pass the check (SCRIPT EXISTS, EXISTS were never probed) and then fail every publish."""
    seen = _commands_a_node_runs(server)
    commands = seen - _HANDSHAKE
    assert {"evalsha", "script|load", "hset", "sscan", "exists"} <= commands, commands
    admin = redis.Redis.from_url(server.url)
    for cmd in sorted(seen & _HANDSHAKE):  # the client library's handshake is not a right the index needs
        admin.execute_command("ACL", "SETUSER", "u", "reset", "on", ">pw", "~*", "&*", "+@all", f"-{cmd}")
        index(server.url, "node-u", username="u", password="pw").close()
    for cmd in sorted(commands):
        admin.execute_command("ACL", "SETUSER", "u", "reset", "on", ">pw", "~*", "&*", "+@all", f"-{cmd}")
        with pytest.raises(ValueError) as err:
            index(server.url, "node-u", username="u", password="pw").close()
        msg = str(err.value)
        assert msg.startswith(("redis_username: user 'u' lacks permission for",
                               "redis_url: access refused")), (cmd, msg)
        assert cmd.replace("|", " ").upper() in msg.upper(), (cmd, msg)
        assert "\n" not in msg
    print("probed at start:", ", ".join(sorted(commands)))


def test_a_user_without_script_exists_publishes(server):
    """Publishing runs EVALSHA (SCRIPT LOAD when the server lacks the script), never SCRIPT EXISTS."""
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "u", "on", ">pw", "~*", "&*", "+@all", "-script|exists")
    a = index(server.url, "node-a", username="u", password="pw")
    b = index(server.url, "node-b")
    keys = [k(i) for i in range(4)]
    a.publish(keys[0], keys, [rec("node-a", i) for i in range(4)])
    assert a.flush(5), a.health()
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    admin.script_flush()  # a restarted Redis: the scripts are loaded again, still without SCRIPT EXISTS
    more = [k(10 + i) for i in range(4)]
    a.publish(more[0], more, [rec("node-a", i) for i in range(4)])
    assert a.flush(5), a.health()
    assert wait_for(lambda: len(b.lookup(more[0], more)) == 4)
    h = a.health()
    assert h["writer_up"] and not h["access_denied"] and not h["last_publish_error"]
    a.close(), b.close()


def test_publish_failures_show_in_health(server):
    a = index(server.url, "node-a")
    real, failing = a._publisher.apply_batch, [True]

    def broken(ops):
        if failing[0]:
            raise redis.ResponseError("ERR Error running script (call to f_1234): @user_script:1: boom")
        return real(ops)

    a._publisher.apply_batch = broken
    a.publish(k(0), [k(0)], [rec("node-a", 0)])
    assert wait_for(lambda: a.health()["publish_failures"] > 0)
    h = a.health()
    assert not h["writer_up"] and "boom" in h["last_publish_error"]
    failing[0] = False
    assert a.flush(10)
    h = a.health()
    assert h["writer_up"] and not h["last_publish_error"]
    a.close()


@pytest.fixture(params=["http", "garbage", "ok-to-everything"])
def not_redis(request) -> str:
    port = {"http": http_server, "garbage": lambda: garbage_server(b"\x00\x01garbage\r\n"),
            "ok-to-everything": lambda: garbage_server(b"+OK\r\n" * 64)}[request.param]()
    return f"redis://127.0.0.1:{port}/0"


def test_a_server_that_does_not_speak_redis_is_a_one_line_error(not_redis):
    for serve in (True, False):
        with pytest.raises(ValueError) as err:
            RedisPrefixIndex(RedisIndexConfig(url=not_redis, node_id="node-a"), serve=serve)
        msg = str(err.value)
        assert msg.startswith(f"redis_url: {not_redis} did not answer as Redis") and "\n" not in msg, msg


def test_the_plugin_names_redis_url_for_a_server_that_is_not_redis(not_redis, tmp_path):
    from radixtier.integrations.sglang.backend.attach import open_index
    from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError
    from radixtier.storage.nvmeof.store import NvmeofPageStore

    cfg = BackendConfig.from_extra_config({"path": str(tmp_path / "ns.img"), "capacity": "16MiB",
                                           "redis_url": not_redis, "node_id": "node-a"})
    store = NvmeofPageStore(cfg.path, 4096, create_bytes=16 << 20, node_id="node-a")
    try:
        with pytest.raises(ConfigError, match=r"^redis_url: .* did not answer as Redis"):
            open_index(cfg, store, "node-a")
    finally:
        store.close()


@pytest.mark.parametrize("field", ["lookup_timeout_s", "connect_timeout_s", "write_timeout_s", "heartbeat_s",
                                   "node_ttl_s", "gc_interval_s", "backoff_max_s"])
def test_absurd_durations_are_refused_naming_the_field(field):
    cfg = RedisIndexConfig(url="redis://127.0.0.1:1/0", node_id="node-a")
    setattr(cfg, field, 1e308)
    with pytest.raises(ValueError, match=rf"^{field}: expected .*got 1e\+308"):
        cfg.validate()
