"""Bad input gets a one-line error naming the field and the value, a non-zero exit, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace
from radixtier.units import parse_size

PAGE = 16 << 10


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixtier", *args], capture_output=True, text=True, timeout=120)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln and not ln.startswith("usage:") and not ln.startswith(" ")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("flag, value, named", [
    ("--page-bytes", "1" + "0" * 400, "--page-bytes"),
    ("--capacity", "9999999TiB", "--capacity"),
    ("--capacity", "1.5", "--capacity"),
    ("--page-bytes", "0", "--page-bytes"),
])
def test_format_refuses_impossible_sizes_without_a_traceback_or_a_file(tmp_path, flag, value, named):
    path = str(tmp_path / "ns.img")
    args = {"--page-bytes": "16KiB", "--capacity": "8MiB"}
    args[flag] = value
    out = run_cli("format", path, "--page-bytes", args["--page-bytes"], "--capacity", args["--capacity"])
    assert out.returncode == 2
    line = one_error_line(out)
    assert named in line and "expected" in line
    assert not os.path.exists(path)


def test_a_format_that_cannot_fit_a_page_leaves_no_file(tmp_path):
    path = str(tmp_path / "ns.img")
    out = run_cli("format", path, "--page-bytes", "64MiB", "--capacity", "64MiB")
    assert out.returncode == 2 and "capacity" in one_error_line(out)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="capacity"):
        format_namespace(path, 1 << 30, capacity_bytes=1 << 20)
    assert not os.path.exists(path)


@pytest.mark.parametrize("keep_bytes", [100, 4096, 3 * 4096, 6 << 20])
def test_inspect_refuses_a_truncated_namespace(tmp_path, keep_bytes):
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20)
    s.put([key(i) for i in range(4)], [torch.full((PAGE // 4,), i, dtype=torch.int32) for i in range(4)])
    s.close()
    os.truncate(path, keep_bytes)  # a data area cut off (or more)
    out = run_cli("inspect", path, "--verify")
    assert out.returncode == 2, out.stdout + out.stderr
    line = one_error_line(out)
    assert path in line and ("truncated" in line or "not a radixtier namespace" in line)


def test_store_api_refuses_wrong_types_with_value_errors(tmp_path):
    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=8 << 20)
    page = torch.zeros(PAGE // 4, dtype=torch.int32)
    assert s.put([key(0)], [page]).ok == [True]
    for call in (lambda: s.get(["0123456789abcdef"], [page]), lambda: s.exists(["0123456789abcdef"]),
                 lambda: s.leading_run(["x"]), lambda: s.location("x"), lambda: s.delete(["x"])):
        with pytest.raises(ValueError, match=r"^key: expected 16 bytes"):
            call()
    with pytest.raises(ValueError, match="read-only"):
        s.get([key(0)], [bytes(PAGE)])
    with pytest.raises(ValueError, match="buffer: expected"):
        s.get([key(0)], ["not a buffer"])
    s.close()


@pytest.mark.parametrize("kw, field", [({"queue_depth": 1.5}, "queue_depth"), ({"queue_depth": 0}, "queue_depth"),
                                       ({"create_bytes": 1.5}, "capacity"), ({"page_bytes": 2.0}, "page_bytes"),
                                       ({"lease_s": float("nan")}, "lease_s"), ({"partition": True}, "partition")])
def test_store_options_refuse_non_integers(tmp_path, kw, field):
    args = dict(page_bytes=PAGE, create_bytes=8 << 20)
    args.update(kw)
    page_bytes = args.pop("page_bytes")
    with pytest.raises(ValueError, match=rf"^{field}: "):
        NvmeofPageStore(str(tmp_path / "ns.img"), page_bytes, **args)


def test_store_config_is_one_validated_object(tmp_path):
    """The store's settings are a frozen StoreConfig: checked once when made, overridable per open,
    and an unknown option is refused by name (never silently ignored)."""
    import dataclasses

    from radixtier.storage.nvmeof.config import StoreConfig

    with pytest.raises(ValueError, match=r"^eviction: expected one of"):
        StoreConfig(eviction="mru")
    with pytest.raises(ValueError, match=r"^lease_s: "):
        StoreConfig(lease_s=1.0, lease_io_timeout_s=1.0)  # a lease must outlast 8 I/O bounds
    cfg = StoreConfig(io_engine="threads", queue_depth=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.queue_depth = 8  # type: ignore[misc]
    path = str(tmp_path / "ns.img")
    with pytest.raises(TypeError, match="unknown option 'queue_dpeth'"):
        NvmeofPageStore(path, PAGE, create_bytes=8 << 20, queue_dpeth=4)
    assert not os.path.exists(path)  # refused before anything was created
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, config=cfg, queue_depth=2)
    assert (s.config.queue_depth, s.config.io_engine, s.io_engine) == (2, "threads", "threads")
    s.close()


@pytest.mark.parametrize("text", ["1.5", "0.3KiB", "1" + "0" * 400, "9999999TiB", "0"])
def test_sizes_are_whole_bytes_in_range(text):
    with pytest.raises(ValueError, match="expected a"):
        parse_size(text)
    assert parse_size("1.5KiB") == 1536


@pytest.mark.parametrize("raw", ["9999999TiB", 10 ** 30, "1" + "0" * 400, 1.5, "1.5"])
def test_sglang_sizes_out_of_range_are_config_errors(raw):
    with pytest.raises(ConfigError, match=r"^capacity: "):
        BackendConfig.from_extra_config({"path": "/tmp/x.img", "capacity": raw})
