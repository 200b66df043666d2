"""The fleet's tier-3 view of one chain (radixtier/fleet/fleet_view.py), over both index implementations."""

from __future__ import annotations


from radixtier.storage.api import HOST_TIER, STORAGE_TIER, PageLocation, PageRecord
from radixtier.fleet.fleet_view import NodeView, fleet_view
from radixtier.storage.index.inprocess import InProcessIndex, InProcessRegistry

POOL, LOCAL = "a" * 32, "b" * 32  # two namespaces: a shared pool, and one only node c attaches


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def rec(node: str, ns: str, slot: int, tier: str = STORAGE_TIER) -> PageRecord:
    return PageRecord(node, tier, PageLocation(ns, slot, 1, 4096, 0))


def publish(index, node: str, ns: str, pages, tier: str = STORAGE_TIER) -> None:
    index.publish(key(0), [key(i) for i in pages], [rec(node, ns, i, tier) for i in pages])


def _fleet(make):
    a, b, c = make("node-a"), make("node-b"), make("node-c")
    publish(a, "node-a", POOL, range(0, 6))      # a wrote the first 6 pages into the pool
    publish(b, "node-b", POOL, range(4, 10))     # b wrote pages 4..9 there: its own run starts late
    publish(c, "node-c", LOCAL, range(0, 3))     # c holds 3 pages in a namespace nobody else attaches
    publish(b, "node-b", POOL, range(10, 12), tier=HOST_TIER)  # host copies are not tier 3
    for x in (a, b, c):
        x.flush()
    return a


def _expect(view) -> None:
    assert view.pool_runs == {POOL: 10, LOCAL: 3}
    assert view.nodes["node-a"] == NodeView(disk=6, external=10)
    assert view.nodes["node-b"] == NodeView(disk=0, external=10)  # none of its own from the start, all readable
    assert view.nodes["node-c"] == NodeView(disk=3, external=3)
    assert view.ranked() == ["node-a", "node-b", "node-c"]


def test_fleet_view_in_process():
    registry = InProcessRegistry()
    a = _fleet(lambda n: InProcessIndex(n, registry))
    _expect(fleet_view(a, key(0), [key(i) for i in range(16)]))


def test_fleet_view_over_redis_in_one_lookup(redis_server, monkeypatch):
    from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

    made = []

    def make(node):
        made.append(RedisPrefixIndex(RedisIndexConfig(url=redis_server.url, node_id=node, namespace="fv")))
        return made[-1]

    try:
        a = _fleet(make)
        calls = []
        real = type(a).lookup
        monkeypatch.setattr(type(a), "lookup", lambda self, *args, **kw: calls.append(1) or real(self, *args, **kw))
        _expect(fleet_view(a, key(0), [key(i) for i in range(16)]))
        assert calls == [1]  # one lookup (one MGET with the root known)
    finally:
        for x in made:
            x.close()
