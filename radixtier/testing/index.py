"""Helpers for the prefix-index tests: a RedisPrefixIndex tuned for fast liveness, page records,
chains published and flushed, and waiting for a condition."""

from __future__ import annotations

import hashlib
import time
from typing import Callable

from radixtier.storage.api import PageLocation, PageRecord
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

NS_UUID = "ab" * 16


def rec(node: str, slot: int) -> PageRecord:
    """A record of page `slot` held by `node` in namespace NS_UUID."""
    return PageRecord(node, "storage", PageLocation(NS_UUID, slot, slot + 1, 4096, 7))


def index(url: str, node: str, **kw) -> RedisPrefixIndex:
    """An index whose heartbeats, liveness, collection and backoff run in fractions of a second."""
    cfg = dict(url=url, node_id=node, namespace="test", heartbeat_s=0.2, node_ttl_s=1.0, gc_interval_s=0.5,
               backoff_initial_s=0.05, backoff_max_s=0.5)
    cfg.update(kw)
    return RedisPrefixIndex(RedisIndexConfig(**cfg))


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def chain_key(i: int) -> bytes:
    """Page key i of the chains publish_chain writes."""
    return hashlib.blake2b(f"h{i}".encode(), digest_size=16).digest()


def publish_chain(ix: RedisPrefixIndex, first: int, n: int) -> list:
    """Publish pages first..first+n-1 as one chain from `ix`'s node and wait until they landed."""
    keys = [chain_key(first + i) for i in range(n)]
    ix.publish(keys[0], keys, [rec(ix.node_id, first + i) for i in range(n)])
    assert ix.flush()
    return keys
