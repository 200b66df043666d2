"""The chain lookup's packed MGET (radixtier/storage/index/packed_mget.py) against redis-py's own mget, on a
real server and a real cluster: same answers, redirects handed back, no stale reply after a timeout."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import redis

from radixtier.storage.index.packed_mget import Redirected, mget_command, packed_mget

from radixtier.testing.redis_server import start_cluster

PREFIX = "radixtier:test:{%s}:p:"


def keys(n: int, tag: str = "k") -> list:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def names(prefix: str, ks: list) -> list:
    return [prefix + k.hex() for k in ks]


def test_the_packed_command_answers_as_redis_py_mget_does(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    ks = keys(512)
    prefix = PREFIX % ks[0].hex()
    for i, name in enumerate(names(prefix, ks)):
        if i % 3:
            client.set(name, bytes([i % 251]) * (i % 97) + b"\r\n$*\0")  # RESP-looking bytes in values
    got = packed_mget(client, mget_command(prefix.encode(), ks), prefix + ks[0].hex())
    assert got == client.mget(names(prefix, ks))
    assert got.count(None) == 171


def test_keys_that_are_not_16_bytes_take_the_generic_path():
    assert mget_command(b"p:", [b"x" * 16, b"y" * 15]) is None
    assert mget_command(b"p:", [b"x" * 15, b"y" * 17]) is None  # the same total length
    assert mget_command(b"p:", []) is None


def test_a_timed_out_reply_is_never_read_as_the_next_answer(redis_server):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.2)
    a, b = keys(4, "a"), keys(4, "b")
    pa, pb = PREFIX % a[0].hex(), PREFIX % b[0].hex()
    for name in names(pa, a):
        client.set(name, b"from-a")
    with redis_server.paused():
        with pytest.raises(redis.TimeoutError):
            packed_mget(client, mget_command(pa.encode(), a), pa + a[0].hex())
    # the server answers the first MGET once it resumes: that reply must not answer the second
    assert packed_mget(client, mget_command(pb.encode(), b), pb + b[0].hex()) == [None] * 4


def test_a_cluster_node_answers_its_slot_and_hands_back_a_redirect(tmp_path):
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed: the Redis Cluster tests need it")
    servers = start_cluster(str(tmp_path))
    try:
        from redis.cluster import RedisCluster

        client = RedisCluster.from_url(f"redis://127.0.0.1:{servers[0].port}/0")
        for c in range(6):  # chains land on different shards
            ks = keys(64, f"c{c}-")
            prefix = PREFIX % ks[0].hex()
            for name in names(prefix, ks)[::2]:
                client.set(name, name.encode())
            assert packed_mget(client, mget_command(prefix.encode(), ks), prefix + ks[0].hex()) == \
                client.mget(names(prefix, ks))
        ks, other = keys(8, "x"), keys(8, "y")
        prefix = PREFIX % ks[0].hex()
        wrong = next(PREFIX % o.hex() + o.hex() for o in other  # a name another shard holds
                     if client.get_node_from_key(PREFIX % o.hex()) != client.get_node_from_key(prefix))
        with pytest.raises(Redirected):  # sent to the wrong shard: MOVED comes back, as Redirected
            packed_mget(client, mget_command(prefix.encode(), ks), wrong)
        client.close()
    finally:
        for s in servers:
            s.stop()
