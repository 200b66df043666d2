"""radixtier: Prometheus metrics: names and types in the text exposition, values that move, SGLang's
multiprocess mode (what its /metrics collects), and the shipped Grafana dashboard."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace
from radixtier.storage.nvmeof.store import NvmeofPageStore

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict:
    """{'name{labels}': value} of a text exposition, and the # TYPE of each family."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def types(text: str) -> dict:
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def total(s: dict, prefix: str, **labels: str) -> float:
    return sum(v for k, v in s.items() if k.startswith(prefix + "{") and all(f'{a}="{b}"' in k for a, b in labels.items()))


def test_the_embedded_engine_serves_its_metrics(tmp_path):
    ps = 4
    store = NvmeofPageStore(str(tmp_path / "ns.img"), ps * 8 * 4, create_bytes=8 << 20, node_id="emb")
    cfg = CacheConfig(page_size=ps, page_shape=(ps, 8), dtype=torch.float32, device_pages=32, host_pages=32,
                      device="cpu", write_policy="write_through", write_through_threshold=1)
    cache = TieredKVCache(cfg, KVNamespace("prom", "float32", "flat", ps), store=store)
    port = free_port()
    cache.serve_metrics(port, interval_s=0.1)
    try:
        tokens = list(range(64))
        cache.insert(tokens, torch.ones(16, ps, 8))
        assert cache.flush(10)
        cache.acquire(tokens).release()
        time.sleep(0.4)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        cache.close()
        store.close()
    t, s = types(text), samples(text)
    for name, kind in {"radixtier:cache_hit_tokens_total": "counter", "radixtier:cache_moved_bytes_total": "counter",
                       "radixtier:storage_written_pages_total": "counter", "radixtier:storage_used_pages": "gauge",
                       "radixtier:storage_capacity_bytes": "gauge",
                       "radixtier:storage_verification_failures_total": "counter",
                       "radixtier:storage_read_seconds": "histogram", "radixtier:index_lookup_seconds": "histogram"}.items():
        assert t.get(name) == kind, (name, t.get(name))
    assert total(s, "radixtier:storage_written_pages_total", node="local") > 0
    assert total(s, "radixtier:storage_used_pages", node="local") > 0
    assert total(s, "radixtier:cache_moved_bytes_total", direction="host_to_storage") > 0
    assert total(s, "radixtier:cache_lookup_tokens_total", node="local") >= 64
    assert total(s, "radixtier:cache_hit_tokens_total", node="local") >= 32  # served from some tier


def test_sglang_multiprocess_mode_reaches_sglang_metrics(tmp_path):
    """In SGLang the metrics are written to PROMETHEUS_MULTIPROC_DIR by the scheduler process and
    collected by another; run a backend that way and collect as SGLang's /metrics does."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    script = textwrap.dedent(f"""
        import dataclasses, sys, torch
        from radixtier.testing.sglang_pools import chain_keys, make_host_pool, slots, scramble, storage_config
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        host = make_host_pool("page_first")
        cfg = storage_config({{"path": {str(tmp_path / 'ns.img')!r}, "capacity": "64MiB", "node_id": "node-m",
                              "interface_v1": 1}})
        cfg = dataclasses.replace(cfg, enable_storage_metrics=True)  # what SGLang's --enable-metrics sets
        b = StorageBackendFactory.create_backend("dynamic", cfg, host)
        b.register_mem_pool_host(host)
        b.register_mem_host_pool_v2(host, PoolName.KV)
        b.on_host_pools_registered()
        keys = chain_keys(6)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        assert all(b.batch_set_v1(keys, slots(0, 6), info))
        scramble(host, 0, 6)
        assert all(b.batch_get_v1(keys, slots(0, 6), info))
        with open(b.store.path, "r+b") as f:  # one flipped payload byte: a checksum failure
            loc = b.store.location(b.keys.chain(keys, None, b._format("kv"), "v1").keys[2])
            f.seek(b.store.sb.slot_offset(loc.slot) + 4096 + 10)
            c = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([c[0] ^ 1]))
        got = b.batch_get_v1(keys, slots(0, 6), info)
        assert got[:2] == [True, True] and not got[2], got
        b.close()
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        reg = CollectorRegistry()
        MultiProcessCollector(reg)
        sys.stdout.write(generate_latest(reg).decode())
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mp_dir), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(mp_dir.iterdir()), "nothing was written to the multiprocess directory"
    text = out.stdout
    t, s = types(text), samples(text)
    assert t.get("radixtier:storage_written_pages_total") == "counter" and t.get("radixtier:storage_read_seconds") == "histogram"
    assert total(s, "radixtier:storage_written_pages_total", node="node-m") == 6
    assert total(s, "radixtier:storage_read_pages_total", node="node-m") == 6 + 5  # all but the flipped one
    assert total(s, "radixtier:storage_verification_failures_total", kind="checksum") == 1
    assert total(s, "radixtier:storage_read_seconds_count", node="node-m") == 2
    assert total(s, "radixtier:storage_capacity_pages", node="node-m") > 0


def test_the_grafana_dashboard_is_valid_and_uses_only_real_metrics():
    from radixtier.prometheus import families

    with open(os.path.join(ROOT, "deploy", "grafana", "radixtier.json")) as f:
        dash = json.load(f)
    fam = families()
    known = {m._name for group in (fam.counters, fam.gauges, fam.histograms) for m in group.values()}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert dash["uid"] == "radixtier" and len(dash["panels"]) >= 8 and exprs
    used = set()
    for e in exprs:
        for name in re.findall(r"radixtier:[a-z_]+", e):
            base = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert base in known, f"dashboard uses {name}, which radixtier does not export"
            used.add(base)
    assert len(used) >= 15  # most of what is exported is on the dashboard
