"""`radixtier index status|gc` against a real redis-server: what an operator sees of the fleet."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from radixtier.cli import main as cli_main
from radixtier.storage.api import PageLocation, PageRecord
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

NS_UUID = "cd" * 16


def k(i: int) -> bytes:
    return hashlib.blake2b(f"cli{i}".encode(), digest_size=16).digest()


def node(url: str, name: str) -> RedisPrefixIndex:
    return RedisPrefixIndex(RedisIndexConfig(url=url, node_id=name, namespace="ops", heartbeat_s=0.2,
                                             node_ttl_s=1.0, gc_interval_s=60))


def publish(ix: RedisPrefixIndex, chains: int, pages: int) -> None:
    for c in range(chains):
        keys = [k(1000 * c + i + (0 if ix.node_id == "node-a" else 10**6)) for i in range(pages)]
        ix.publish(keys[0], keys, [PageRecord(ix.node_id, "storage", PageLocation(NS_UUID, i, i + 1, 4096, 1))
                                   for i in range(pages)])
    assert ix.flush(10)


def run_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert cli_main(list(args) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_shows_live_and_dead_nodes_and_gc_removes_the_dead(redis_server, capsys):
    a, b = node(redis_server.url, "node-a"), node(redis_server.url, "node-b")
    publish(a, chains=2, pages=5)
    publish(b, chains=1, pages=3)
    b._stop.set()  # node B hangs: its heartbeat expires, its records stay until collected
    b._worker.join()
    time.sleep(1.3)
    rep = run_json(capsys, "index", "status", "--url", redis_server.url, "--namespace", "ops", "--check")
    rows = {r["node"]: r for r in rep["nodes"]}
    assert rep["live"] == 1 and rep["dead"] == 1
    assert rows["node-a"]["alive"] and rows["node-a"]["pages"] == 10 and rows["node-a"]["chains"] == 2
    assert rows["node-a"]["last_heartbeat_s_ago"] < 1.0 and rows["node-a"]["redis_bytes"] > 0
    assert not rows["node-b"]["alive"] and rows["node-b"]["pages"] == 3 and rows["node-b"]["chains"] == 1
    assert 1.0 <= rows["node-b"]["last_heartbeat_s_ago"] < 30  # known after its heartbeat key expired
    assert rows["node-a"]["rejected_entries"] == 0
    assert "radixtier-admin" not in rows  # the tool never joins the fleet
    out = run_json(capsys, "index", "gc", "--url", redis_server.url, "--namespace", "ops")
    assert out["removed_pages"] == 3
    rep = run_json(capsys, "index", "status", "--url", redis_server.url, "--namespace", "ops")
    assert [r["node"] for r in rep["nodes"]] == ["node-a"]
    capsys.readouterr()
    assert cli_main(["index", "status", "--url", redis_server.url, "--namespace", "ops"]) == 0
    text = capsys.readouterr().out
    assert "1 live, 0 dead" in text and "node-a" in text and "10" in text
    a.close()


@pytest.mark.parametrize("args, message", [
    (["--url", "http://x"], "redis_url: expected redis://"),
    (["--url", "redis://127.0.0.1:1/0"], "redis_url: redis://127.0.0.1:1/0 is not reachable"),
    (["--url", "redis://127.0.0.1:1/0", "--ssl-certfile", "c.pem"], "ssl_certfile: set to 'c.pem'"),
    ([], "redis_url: give --url"),
    (["--url", "redis://127.0.0.1:1/0", "--timeout", "1e308"], "--timeout: expected"),
    (["--url", "redis://127.0.0.1:1/0", "--timeout", "nan"], "--timeout: expected"),
    (["--url", "redis://127.0.0.1:1/0", "--timeout", "0"], "--timeout: expected"),
    (["--url", "redis://127.0.0.1:1/0", "--timeout", "-1"], "--timeout: expected"),
    (["--url", "redis://127.0.0.1:1/0", "--timeout", "soon"], "--timeout: expected"),
])
def test_bad_options_get_one_line_errors(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RADIXTIER_REDIS_URL", raising=False)
    assert cli_main(["index", "status"] + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_url_that_is_not_redis_is_one_line(capsys):
    from radixtier.testing.fake_servers import garbage_server, http_server

    for port in (http_server(), garbage_server(b"\x00\x01garbage\r\n")):
        url = f"redis://127.0.0.1:{port}/0"
        for action in ("status", "gc"):
            assert cli_main(["index", action, "--url", url]) == 2
            err = capsys.readouterr().err
            assert f"redis_url: {url} did not answer as Redis" in err and "Traceback" not in err
            assert len(err.strip().splitlines()) == 1


def test_status_and_gc_report_bad_registry_data_and_go_on(redis_server, capsys):
    """An undecodable node id, a node whose pages hash is a string: reported, the rest listed;
    gc removes them with the dead nodes' records."""
    import redis

    a, b = node(redis_server.url, "node-a"), node(redis_server.url, "node-b")
    publish(a, chains=1, pages=2)
    publish(b, chains=1, pages=3)
    b._stop.set()
    b._worker.join()
    raw = redis.Redis.from_url(redis_server.url)
    prefix = "radixtier:ops"
    raw.sadd(f"{prefix}:{{nodes}}:all", b"\xff\xfe-junk", "node-z")
    raw.set(f"{prefix}:{{o:node-z}}", "not a hash")
    time.sleep(1.3)
    rep = run_json(capsys, "index", "status", "--url", redis_server.url, "--namespace", "ops", "--check")
    rows = {r["node"]: r for r in rep["nodes"]}
    assert rows["node-a"]["alive"] and rows["node-a"]["pages"] == 2
    assert not rows["node-b"]["alive"] and rows["node-b"]["pages"] == 3
    problems = " | ".join(rep["problems"])
    assert "not UTF-8" in problems and "node-z" in problems, problems
    capsys.readouterr()
    assert cli_main(["index", "status", "--url", redis_server.url, "--namespace", "ops"]) == 0
    text = capsys.readouterr().out
    assert "node-a" in text and "not UTF-8" in text
    out = run_json(capsys, "index", "gc", "--url", redis_server.url, "--namespace", "ops")
    assert out["removed_pages"] == 3
    rep = run_json(capsys, "index", "status", "--url", redis_server.url, "--namespace", "ops")
    assert [r["node"] for r in rep["nodes"]] == ["node-a"] and rep["problems"] == []
    a.close()


def test_status_reports_a_wrong_type_node_set(redis_server, capsys):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    raw.set("radixtier:ops:{nodes}:all", "junk")
    raw.set("radixtier:ops:{nodes}:beats", "junk")
    rep = run_json(capsys, "index", "status", "--url", redis_server.url, "--namespace", "ops")
    problems = " | ".join(rep["problems"])
    assert "radixtier:ops:{nodes}:all" in problems and "radixtier:ops:{nodes}:beats" in problems, problems
    out = run_json(capsys, "index", "gc", "--url", redis_server.url, "--namespace", "ops")
    assert out["removed_pages"] == 0
