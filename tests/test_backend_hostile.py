"""The SGLang backend against arguments SGLang itself would never send (issue 28, items 4 and 8).

A storage backend gets raw slot numbers into SGLang's host KV pool and turns them into memory
addresses; a bad one must fail the call (one rate-limited log line), never reach memory outside
the slots it names. Each pool here sits inside a larger allocation whose guard bytes on both
sides are checked after every call: a write past the pool lands there instead of in someone
else's memory. Arguments of the wrong type, a capacity no filesystem holds and an absurd
redis_url are refused with one line naming the field, before anything is created.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from radixtier.testing.skips import require_sglang  # noqa: E402

require_sglang("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy,  # noqa: E402
                                                  PoolName, PoolTransfer)

from radixtier.integrations.sglang.backend import radixtier_storage as backend_module  # noqa: E402
from radixtier.integrations.sglang.backend.radixtier_storage import RadixTierStorage  # noqa: E402
from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError  # noqa: E402
from radixtier.storage.nvmeof.io_engine import uring_unusable_reason  # noqa: E402
from radixtier.testing.sglang_pools import (PAGE, Guarded, PageFirstOnlyHost, attach,  # noqa: E402
                                            attach_with_sidecar, chain_keys, make_host_pool, slots, storage_config)

pytestmark = pytest.mark.sglang
FAR = 1 << 40    # the index that crashed the process (SIGSEGV) on both engines
ENGINES = [pytest.param("threads"),
           pytest.param("io_uring", marks=pytest.mark.skipif(bool(uring_unusable_reason()),
                                                             reason=f"io_uring: {uring_unusable_reason()}"))]
LAYOUTS = ("page_first", "layer_first")
INFO = HiCacheStorageExtraInfo(prefix_keys=[])


def page_at(start: int) -> torch.Tensor:
    return torch.arange(start, start + PAGE, dtype=torch.int64)


def bad_indices(size: int) -> dict:
    """Two pages each: a good page 0, then a hostile second page (the call must fail as a whole)."""
    good = page_at(0)
    inside_but_scrambled = page_at(PAGE).clone()
    inside_but_scrambled[5] = size + 3  # one slot of the page outside the pool
    return {
        "past_end": torch.cat([good, page_at(size)]),
        "straddles_end": torch.cat([good, page_at(size - PAGE // 2)]),
        "negative": torch.cat([good, page_at(-PAGE)]),
        "unaligned": torch.cat([good, page_at(PAGE + PAGE // 2)]),
        "slot_outside_page": torch.cat([good, inside_but_scrambled]),
    }


CASES = ("past_end", "straddles_end", "negative", "unaligned", "slot_outside_page")


@pytest.fixture
def ns(tmp_path):
    return {"path": str(tmp_path / "ns.img"), "capacity": "64MiB", "node_id": "node-a", "interface_v1": 1}


# ---------------------------------------------------------------- host_indices outside the pool
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_get_with_indices_outside_the_pool_fails_and_writes_nothing(ns, engine, layout, case):
    pool = Guarded(layout)
    b = attach(pool.host, {**ns, "io_engine": engine})
    keys = chain_keys(2, f"get-{case}")
    assert b.batch_set_v1(keys, slots(2, 2), INFO) == [True, True]  # both pages are in tier 3
    before = pool.snapshot()
    assert b.batch_get_v1(keys, bad_indices(pool.host.size)[case], INFO) == [False, False]
    assert pool.guards_intact(), "a read wrote past the host pool"
    assert pool.unchanged_since(before), "a refused read still wrote into the pool"
    assert b.batch_get_v1(keys, slots(6, 2), INFO) == [True, True]  # the backend still works
    b.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_set_with_indices_outside_the_pool_stores_nothing(ns, engine, layout, case):
    pool = Guarded(layout)
    b = attach(pool.host, {**ns, "io_engine": engine})
    keys = chain_keys(2, f"set-{case}")
    assert b.batch_set_v1(keys, bad_indices(pool.host.size)[case], INFO) == [False, False]
    assert len(b.store) == 0 and b.batch_exists(keys, INFO) == 0
    before = pool.snapshot()
    assert b.batch_get_v1(keys, slots(6, 2), INFO) == [False, False]
    assert pool.unchanged_since(before) and pool.guards_intact()
    b.close()


def test_bad_host_indices_log_one_rate_limited_line(ns, caplog):
    """A caller stuck on a bad index must not flood the log: one line names host_indices, the bad
    value and the pool's size; every refused call is still counted."""
    pool = Guarded("page_first")
    b = attach(pool.host, ns)
    keys = chain_keys(1, "flood")
    with caplog.at_level(logging.ERROR, logger="radixtier.sglang"):
        for _ in range(5):
            assert b.batch_get_v1(keys, page_at(FAR), INFO) == [False]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and "host_indices" in line and str(FAR) in line and str(pool.host.size) in line
    assert b.radixtier_stats()["errors"] == 5
    b.close()


def test_the_next_line_after_the_quiet_interval_counts_what_it_left_out(ns, caplog, monkeypatch):
    b = attach(make_host_pool("page_first"), ns)
    monkeypatch.setattr(b._refusals, "every_s", 0.2)
    keys = chain_keys(1, "quiet")
    with caplog.at_level(logging.ERROR, logger="radixtier.sglang"):
        for _ in range(3):
            b.batch_set_v1(keys, page_at(-PAGE), INFO)
        time.sleep(0.3)
        b.batch_set_v1(keys, page_at(-PAGE), INFO)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 2 and "(2 more refused like it in the last" in lines[1], lines
    b.close()


@pytest.mark.parametrize("host_indices, shown", [
    (list(range(PAGE)), "list"),
    (torch.arange(PAGE, dtype=torch.float32), "float32"),
    (torch.zeros(PAGE, dtype=torch.bool), "bool"),
])
def test_host_indices_of_the_wrong_type_fail_the_call_by_name(ns, caplog, host_indices, shown):
    pool = Guarded("page_first")
    b = attach(pool.host, ns)
    before = pool.snapshot()
    with caplog.at_level(logging.ERROR, logger="radixtier.sglang"):
        assert b.batch_set_v1(chain_keys(1, "type"), host_indices, INFO) == [False]
        assert b.batch_get_v1(chain_keys(1, "type"), host_indices, INFO) == [False]
    assert "host_indices: expected" in caplog.text and shown in caplog.text
    assert pool.unchanged_since(before) and len(b.store) == 0
    b.close()


@pytest.mark.parametrize("side_layout", ["page_first", "layer_first"])
def test_sidecar_pool_indices_are_checked_against_that_pool(ns, side_layout):
    """v2 transfers name slots of the sidecar pool (zero copy in page_first, flat pages in
    layer_first for a pool that has no zero-copy walk there): its own size bounds them."""

    host = make_host_pool(side_layout, seed=1)
    side = Guarded(side_layout, seed=2, layers=1)
    side.host.__class__ = PageFirstOnlyHost  # the zero-copy walk refused outside page_first, like mamba's
    b = attach_with_sidecar(host, side.host, PoolName.MAMBA, ns)
    keys, others = chain_keys(2, f"side-{side_layout}"), chain_keys(2, f"side-other-{side_layout}")
    assert all(b.batch_set_v1(keys, slots(0, 2), INFO)) and all(b.batch_set_v1(others, slots(2, 2), INFO))

    def transfer(ks, indices):
        return [PoolTransfer(name=PoolName.MAMBA, host_indices=indices, keys=ks, hit_policy=PoolHitPolicy.ALL_PAGES)]

    assert b.batch_set_v2(transfer(keys, slots(0, 2)), INFO) == {"mamba": [True, True]}
    held = len(b.store)
    before = side.snapshot()
    bad = torch.cat([page_at(4 * PAGE), page_at(side.host.size)])  # a good page that the read would change
    assert b.batch_get_v2(transfer(keys, bad), INFO) == {"mamba": [False, False]}
    assert b.batch_set_v2(transfer(others, bad), INFO) == {"mamba": [False, False]}
    assert side.guards_intact() and side.unchanged_since(before) and len(b.store) == held
    b.close()


FAR_SCRIPT = r"""
import json, sys, tempfile
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from radixtier.testing.sglang_pools import PAGE, Guarded, attach, chain_keys, slots

FAR, INFO = 1 << 40, HiCacheStorageExtraInfo(prefix_keys=[])
out = []
for engine in sys.argv[1:]:
    pool = Guarded("page_first")
    b = attach(pool.host, {"path": tempfile.mkdtemp() + "/ns.img", "capacity": "64MiB", "node_id": "n",
                           "interface_v1": 1, "io_engine": engine})
    keys = chain_keys(1, "far-" + engine)
    stored = b.batch_set_v1(keys, slots(0, 1), INFO)
    for index in (FAR, -FAR):
        before = pool.snapshot()
        page = torch.arange(index, index + PAGE, dtype=torch.int64)
        got = b.batch_get_v1(keys, page, INFO)
        put = b.batch_set_v1(chain_keys(1, "far-set-" + engine), page, INFO)
        out.append({"engine": engine, "index": index, "stored": stored, "get": got, "set": put,
                    "held": len(b.store), "intact": pool.unchanged_since(before)})
    b.close()
print("RESULT " + json.dumps(out))
"""


def test_index_of_2_to_the_40_fails_the_call_on_both_engines(tmp_path):
    """Run apart: before the bounds check this index crashed the process (SIGSEGV) on both engines."""
    engines = ["threads"] + ([] if uring_unusable_reason() else ["io_uring"])
    proc = subprocess.run([sys.executable, "-c", FAR_SCRIPT, *engines], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(results) == 2 * len(engines)
    for r in results:
        assert r["stored"] == [True] and r["get"] == [False] and r["set"] == [False], r
        assert r["held"] == 1 and r["intact"], r
    assert "host_indices: expected" in proc.stderr and str(FAR) in proc.stderr


# ---------------------------------------------------------------- keys that are not a list
def _calls(b: RadixTierStorage, keys):
    transfer = PoolTransfer(name=PoolName.KV, host_indices=slots(0, 1), keys=keys)
    return {
        "batch_get_v1": lambda: b.batch_get_v1(keys, slots(0, 1), INFO),
        "batch_set_v1": lambda: b.batch_set_v1(keys, slots(0, 1), INFO),
        "batch_exists": lambda: b.batch_exists(keys, INFO),
        "batch_exists_v2": lambda: b.batch_exists_v2(keys, [], INFO),
        "batch_get": lambda: b.batch_get(keys, [torch.zeros(8)]),
        "batch_set": lambda: b.batch_set(keys, [torch.zeros(8)]),
        "batch_get_v2": lambda: b.batch_get_v2([transfer], INFO),
        "batch_set_v2": lambda: b.batch_set_v2([transfer], INFO),
    }


METHODS = ("batch_get_v1", "batch_set_v1", "batch_exists", "batch_exists_v2", "batch_get", "batch_set",
           "batch_get_v2", "batch_set_v2")
TYPE_NAMES = {"None": "NoneType", "generator": "generator", "str": "str", "int": "int"}


@pytest.mark.parametrize("method, kind", [(m, k) for m in METHODS for k in TYPE_NAMES
                                          if not (m.endswith("_v2") and m != "batch_exists_v2" and k == "None")])
def test_keys_that_are_not_a_list_are_refused_by_name(ns, method, kind):
    """SGLang always passes a list; anything else gets a ValueError naming keys and the type it got,
    not a TypeError from deep inside (a per-key result needs a length to be given at all). A v2
    transfer's keys of None stay what they were: that pool has nothing to move."""
    keys = {"None": None, "generator": (k for k in chain_keys(1)), "str": chain_keys(1)[0], "int": 7}[kind]
    b = attach(make_host_pool("page_first"), ns)
    with pytest.raises(ValueError, match=rf"keys: expected a list of page hash strings, got {TYPE_NAMES[kind]}$"):
        _calls(b, keys)[method]()
    assert len(b.store) == 0
    b.close()


@pytest.mark.parametrize("method", ["batch_get_v2", "batch_set_v2"])
@pytest.mark.parametrize("transfers", [None, 7, "kv"])
def test_transfers_that_are_not_a_list_are_refused_by_name(ns, method, transfers):
    b = attach(make_host_pool("page_first"), ns)
    with pytest.raises(ValueError, match=r"^transfers: expected a list of PoolTransfer, got "):
        getattr(b, method)(transfers, INFO)
    b.close()


def test_a_key_that_is_not_a_string_is_a_miss(ns, caplog):
    b = attach(make_host_pool("page_first"), ns)
    with caplog.at_level(logging.ERROR, logger="radixtier.sglang"):
        assert b.exists(None) is False
        assert b.batch_get_v1([None], slots(0, 1), INFO) == [False]
    assert "key: expected a non-empty page hash string, got None" in caplog.text
    b.close()


# ---------------------------------------------------------------- capacity the filesystem cannot hold
def test_capacity_beyond_the_filesystem_is_refused_before_anything_exists(tmp_path):
    path = tmp_path / "sub" / "ns.img"
    with pytest.raises(ConfigError) as err:
        BackendConfig.from_extra_config({"path": str(path), "capacity": "4000TiB"})
    line = str(err.value)
    assert line.startswith("capacity: expected at most ") and "got 4000TiB" in line and "\n" not in line
    with pytest.raises(ConfigError, match=r"^capacity: expected at most .*got 4000TiB"):
        attach(make_host_pool("page_first"), {"path": str(path), "capacity": "4000TiB"})
    assert not path.exists() and not path.parent.exists()


def test_capacity_is_not_checked_against_an_existing_namespace(ns):
    """capacity only creates a file namespace; one that exists keeps its own size, so a huge value
    there is not an error (and nothing is recreated)."""
    attach(make_host_pool("page_first"), ns).close()
    size = os.path.getsize(ns["path"])
    attach(make_host_pool("page_first"), {**ns, "capacity": "4000TiB"}).close()
    assert os.path.getsize(ns["path"]) == size


def test_a_file_too_large_for_the_filesystem_names_capacity(ns, monkeypatch):
    """Room enough but past the filesystem's largest file (ext4: 16 TiB): EFBIG as a capacity error."""
    def too_large(*_a, **_k):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(backend_module, "open_partition", too_large)
    with pytest.raises(ConfigError, match=r"^capacity: expected a size the filesystem holding .* can hold "
                                          r"\(File too large\), got 64MiB \(67108864 bytes\)$"):
        attach(make_host_pool("page_first"), ns)


# ---------------------------------------------------------------- redis_url
@pytest.mark.parametrize("url, why", [
    ("redis://" + "a" * 1_000_000 + ":6379/0", "at most"),
    ("redis://" + "a" * 64 + ".example:6379/0", "host"),
    ("redis://" + ".".join(["abcdefghij"] * 30) + ":6379/0", "host"),
    ("redis://bad host:6379/0", "host"),
    ("redis://a..b:6379/0", "host"),
    ("redis://localhost:99999/0", "port"),
    ("redis://localhost:port/0", "port"),
])
def test_redis_url_is_refused_by_name_before_anything_exists(tmp_path, url, why):
    path = tmp_path / "ns.img"
    extra = {"path": str(path), "capacity": "64MiB", "redis_url": url}
    with pytest.raises(ConfigError) as err:
        BackendConfig.from_extra_config(extra)
    line = str(err.value)
    assert line.startswith("redis_url: expected ") and why in line and "\n" not in line
    assert len(line) < 400, "the value is echoed back whole"
    with pytest.raises(ConfigError, match=r"^redis_url: expected "):
        RadixTierStorage(storage_config(extra), {})
    assert not path.exists()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6400/0", "redis://[::1]:6400/0", "redis://redis-0.svc.local/0",
                                 "rediss://user:pw@cache_1:6400/0", "unix:///tmp/redis.sock", "redis://"])
def test_ordinary_redis_urls_pass(tmp_path, url):
    cfg = BackendConfig.from_extra_config({"path": str(tmp_path / "ns.img"), "redis_url": url})
    assert cfg.redis_url == url


def test_a_long_bad_scheme_is_not_echoed_whole(tmp_path):
    url = "ftp://" + "x" * 3000
    with pytest.raises(ConfigError) as err:
        BackendConfig.from_extra_config({"path": str(tmp_path / "ns.img"), "redis_url": url})
    assert str(err.value).startswith("redis_url: expected redis://") and len(str(err.value)) < 400


def test_a_redis_url_that_is_not_redis_leaves_no_namespace_behind(tmp_path):
    """The namespace file is created before the index is reached: a start that then fails on the
    index (not Redis here; a duplicate live node_id alike) removes the file it created."""
    from radixtier.testing.fake_servers import garbage_server

    port = garbage_server(b"\x00\x01garbage\r\n")
    path = tmp_path / "ns.img"
    host = make_host_pool("page_first")
    with pytest.raises(ConfigError, match=r"^redis_url: .* did not answer as Redis"):
        attach(host, {"path": str(path), "capacity": "64MiB", "redis_url": f"redis://127.0.0.1:{port}/0"})
    assert not path.exists()
