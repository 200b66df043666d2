"""Shared fixtures: namespaces on files and loop devices, deterministic page contents."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from radixtier.hashing import KVNamespace

# Partition leases wait 2.5 lease I/O bounds when a partition is opened (storage/nvmeof/lease.py); the
# suite opens namespaces hundreds of times on files in RAM, so it runs with a 50 ms bound instead of
# the 1 s default (subprocesses, SGLang servers included, inherit it). Tests of the timing itself set
# their own values.
os.environ.setdefault("RADIXTIER_LEASE_IO_TIMEOUT_S", "0.05")


def page_content(key: bytes, numel: int) -> torch.Tensor:
    """Page bytes derived from the page key, so any read can be checked without a side table."""
    raw = hashlib.shake_256(key).digest(numel * 4)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())


@pytest.fixture
def ns4() -> KVNamespace:
    return KVNamespace(model="test-model", dtype="int32", layout="flat", page_size=4)


@pytest.fixture
def ns_file(tmp_path) -> str:
    return os.path.join(str(tmp_path), "namespace.img")


@pytest.fixture
def redis_server(tmp_path):
    from redis_server import RedisServer

    srv = RedisServer(str(tmp_path / "redis"))
    yield srv
    srv.stop()


def require_sglang(module: str) -> None:
    """Import `module` (which needs sglang 0.5.23) or skip the calling test module; under CI a broken
    install fails the run instead of passing as "skipped"."""
    import importlib
    import os

    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI=true: sglang 0.5.23 does not import ({exc}); "
                               f"bash scripts/setup.sh --test installs it") from exc
        pytest.skip(f"needs sglang 0.5.23 (bash scripts/setup.sh --test): {exc}", allow_module_level=True)
