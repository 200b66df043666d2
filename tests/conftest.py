"""Shared fixtures: namespaces, a private redis-server, the SGLang import check (helpers that tests,
subprocesses and benchmarks share live in radixtier.testing)."""

from __future__ import annotations

import os

import pytest

from radixtier.hashing import KVNamespace

# Partition leases wait 2.5 lease I/O bounds when a partition is opened (radixtier/storage/nvmeof/lease.py); the
# suite opens namespaces hundreds of times on files in RAM, so it runs with a 50 ms bound instead of
# the 1 s default (subprocesses, SGLang servers included, inherit it). Tests of the timing itself set
# their own values.
os.environ.setdefault("RADIXTIER_LEASE_IO_TIMEOUT_S", "0.05")


@pytest.fixture
def ns4() -> KVNamespace:
    return KVNamespace(model="test-model", dtype="int32", layout="flat", page_size=4)


@pytest.fixture
def ns_file(tmp_path) -> str:
    return os.path.join(str(tmp_path), "namespace.img")


@pytest.fixture
def redis_server(tmp_path):
    from radixtier.testing.redis_server import RedisServer

    srv = RedisServer(str(tmp_path / "redis"))
    yield srv
    srv.stop()
