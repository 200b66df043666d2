"""The serving loop, the demo and the TTFT benchmark's paths, on the tiny toy model."""

from __future__ import annotations

import json
import subprocess
import sys
import argparse

import pytest
import torch

pytest.importorskip("transformers", reason="the toy model needs transformers (bash scripts/setup.sh --test)")

from radixtier.cache import CacheConfig, TieredKVCache  # noqa: E402
from radixtier.hashing import KVNamespace  # noqa: E402
from radixtier.demo.serving import RecomputePath, TieredPath, serve, summarize  # noqa: E402
from radixtier.storage.nvmeof.store import NvmeofPageStore  # noqa: E402
from radixtier.demo.toymodel import ModelSpec, ToyLlama  # noqa: E402
from radixtier.demo.workloads import agent_types, document_chat, multi_turn_chat  # noqa: E402



@pytest.fixture(scope="module")
def model() -> ToyLlama:
    return ToyLlama(ModelSpec("tiny", page_size=16))


def tiered(model: ToyLlama, path: str, device_pages: int = 24, host_pages: int = 24) -> TieredKVCache:
    ns = KVNamespace("toy-tiny", "float32", "page_first", 16)
    store = NvmeofPageStore(path, model.kv_bytes_per_token * 16, create_bytes=32 << 20)
    cfg = CacheConfig(page_size=16, page_shape=model.page_shape, dtype=model.dtype, device_pages=device_pages,
                      host_pages=host_pages, device="cpu", prefetch_policy="wait_complete")
    return TieredKVCache(cfg, ns, store=store)


@pytest.mark.parametrize("concurrency, window", [(1, 0), (3, 1), (3, 4)])
def test_tiered_serving_reuses_kv_and_answers_like_recompute(model, tmp_path, concurrency, window):
    sessions = document_chat(4, 3, 32, 160, 16, 16, seed=5)  # ~18 pages a session, 72 in all
    base, _ = serve(model, RecomputePath(), sessions, concurrency)
    cache = tiered(model, str(tmp_path / "ns.img"), 40, 24)  # 64 pages of memory tiers: tier 3 serves the rest
    try:
        got, wall = serve(model, TieredPath(cache), sessions, concurrency, prefetch_window=window)
    finally:
        cache.close()
        cache.store.close()
    want = {(r.session, r.turn): r.first_token for r in base}
    assert {(r.session, r.turn): r.first_token for r in got} == want
    s = summarize(got, wall)
    assert s["requests"] == 12 and s["hit_rate"] > 0.3
    assert s["hit_tokens_by_tier"].get("storage", 0) > 0, s["hit_tokens_by_tier"]


def test_serve_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="concurrency"):
        serve(model, RecomputePath(), [], 0)
    with pytest.raises(ValueError, match="prefetch_window"):
        serve(model, RecomputePath(), [], 1, prefetch_window=-1)


def test_worth_reusing_on_cpu(model):
    assert model.worth_reusing(1024, 2048)  # short prompts: reuse always pays
    assert not model.worth_reusing(4096, 16384)  # the masked CPU path costs more than it saves
    assert model.worth_reusing(12288, 16384)
    assert not model.worth_reusing(0, 100)


def test_workloads_share_what_they_should():
    chat = multi_turn_chat(2, 2, 32, 8, 8, seed=1)
    assert chat[0][0].tokens[:32] == chat[1][0].tokens[:32]  # one system prompt
    assert chat[0][1].tokens[:len(chat[0][0].tokens)] == chat[0][0].tokens  # a turn extends the last
    docs = document_chat(2, 2, 16, 64, 8, 8, seed=1)
    assert docs[0][0].tokens[:16] == docs[1][0].tokens[:16] and docs[0][0].tokens[16:80] != docs[1][0].tokens[16:80]
    agents = agent_types(3, 2, 2, 32, 8, 4)
    assert [s[0].session for s in agents[:3]] == ["agent-0-0", "agent-1-0", "agent-2-0"]  # types alternate
    assert agents[0][0].tokens[:32] == agents[3][0].tokens[:32] != agents[1][0].tokens[:32]


def test_embedded_demo_runs_and_reports(tmp_path):
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    r = subprocess.run([sys.executable, "-m", "radixtier", "demo", "--embedded", "--quick", "--model", "tiny",
                        "--json", str(out),
                        "--png", str(png)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TTFT" in r.stdout and "first tokens identical" in r.stdout and "planner" in r.stdout
    assert png.stat().st_size > 10_000
    report = json.loads(out.read_text())
    for w in report["workloads"].values():
        same, total = w["radixtier_vs_recompute"]["first_tokens_identical"].split("/")
        assert same == total
        assert w["paths"]["radixtier"]["hit_rate"] > 0.3
        assert w["paths"]["radixtier"]["hit_tokens_by_tier"].get("storage", 0) > 0  # tier 3 served part of it
        assert w["tiers"]["host_pages"] == 2 * w["tiers"]["device_pages"]  # SGLang's default hicache ratio
        assert w["paths"]["radixtier"]["hit_tokens_by_tier"].get("host", 0) > 0  # all three tiers serve
        assert w["paths"]["radixtier"]["ttft_mean_predicted_s"] > 0


@pytest.mark.parametrize("embedded", [["--embedded", "--model", "tiny"], []], ids=["embedded", "sglang-server"])
def test_demo_refuses_to_clear_a_namespace_that_holds_pages(tmp_path, embedded):
    path = str(tmp_path / "ns.img")
    model = ToyLlama(ModelSpec("tiny", page_size=16))
    s = NvmeofPageStore(path, model.kv_bytes_per_token * 16, create_bytes=32 << 20)
    s.put([bytes(16)], [torch.zeros(model.kv_bytes_per_token * 4, dtype=torch.int32)])
    s.close()
    r = subprocess.run([sys.executable, "-m", "radixtier", "demo", "--quick", *embedded, "--namespace", path],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--force" in r.stderr and "Traceback" not in r.stderr
    s = NvmeofPageStore(path, model.kv_bytes_per_token * 16)
    assert len(s) == 1  # untouched
    s.close()


def test_a_queued_request_reuses_what_ran_while_it_waited(model, tmp_path):
    """Prefetched on arrival before the request ahead of it cached their shared system prompt,
    it is planned again at schedule time and reuses that prompt."""
    agents = agent_types(1, 2, 1, 64, 16, 8, seed=9)  # two agents, one system prompt of 4 pages
    cache = tiered(model, str(tmp_path / "ns.img"), 24, 24)
    try:
        got, _ = serve(model, TieredPath(cache), agents, concurrency=2, prefetch_window=1)
    finally:
        cache.close()
        cache.store.close()
    by = {r.session: r for r in got}
    assert by["agent-0-0"].reused_tokens == 0
    assert by["agent-0-1"].reused_tokens == 64


def test_naive_baseline_store_round_trip_and_capacity(tmp_path):
    from radixtier.testing.naive_store import OneFilePerPageStore

    s = OneFilePerPageStore(str(tmp_path / "files"), 4096, capacity_pages=3)
    keys = [bytes([i]) * 16 for i in range(4)]
    pages = [torch.full((1024,), i, dtype=torch.int32) for i in range(4)]
    assert s.put(keys[:3], pages[:3], [None, keys[0], keys[1]]).ok == [True] * 3
    res = s.put(keys[3:], pages[3:], [None])
    assert res.ok == [True] and res.evicted == [keys[2]]  # leaves first: the chain's tail goes
    out = [torch.zeros(1024, dtype=torch.int32) for _ in range(4)]
    assert s.get(keys, out) == [True, True, False, True]
    assert torch.equal(out[1], pages[1]) and torch.equal(out[3], pages[3])
    assert s.leading_run(keys) == 2


def test_ttft_bench_paths_agree_with_recompute(tmp_path):
    """The benchmark's three paths, with emulated KV size: ballast never reaches the model."""
    from radixtier.testing.bench_scripts import load_bench

    ttft = load_bench("ttft")
    a = argparse.Namespace(model="tiny", page_size=16, device="cpu", queue_depth=8, workdir=str(tmp_path),
                           prefetch_window=1, kv_bytes_per_token=4096)
    b = ttft.Bench(a)
    try:
        sc = ttft.Scenario("t", 2, 512, 4, 2)
        load = ttft.workload(sc)

        class Bar:
            def update(self, n):
                pass

        runs = {p: b.run_path(p, sc, load, Bar()) for p in ttft.PATHS}
    finally:
        b.close()
    assert b.page_bytes == 4096 * 16 and b.extra > 0
    for p in ("local-disk", "radixtier"):
        assert runs[p][1] == runs["recompute"][1]
        assert runs[p][0]["hit_rate"] > 0.3
    report = {"model": "tiny", "device": "cpu", "page_size": 16, "page_bytes": b.page_bytes,
              "kv_bytes_per_token": 4096, "model_kv_bytes_per_token": 512,
              "scenarios": {"t": {"paths": {p: r[0] for p, r in runs.items()},
                                  "ratios": ttft.ratios({p: r[0] for p, r in runs.items()}),
                                  "first_tokens_identical": "all"}}}
    md = ttft.markdown(report)
    assert "| t | radixtier |" in md and "recompute / radixtier" in md
