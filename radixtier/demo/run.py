"""`radixtier demo`: serve a multi-turn chat and an agent-fleet workload through the tiers on the
embedded default (file-backed namespace, in-process index) and print TTFT and throughput
against recompute.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from typing import Dict, Tuple

import torch
from tqdm import tqdm

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace
from radixtier.demo.serving import RecomputePath, TieredPath, serve, summarize
from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.storage.index.inprocess import InProcessIndex
from radixtier.demo.predict import MeasuredHardware, measure_prefill, predicted_mean_ttft, reuse_by_tier
from radixtier.demo.toymodel import SIZES, ModelSpec, ToyLlama
from radixtier.costmodel import measure_read_gbps
from radixtier.demo.workloads import agent_types, multi_turn_chat


def add_demo_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="small", choices=sorted(SIZES), help="toy Llama size (random weights)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="clients sending requests at once")
    ap.add_argument("--sessions", type=int, default=16, help="chat sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns per chat session")
    ap.add_argument("--agents", type=int, default=12, help="agents; each pair shares one system prompt")
    ap.add_argument("--system-tokens", type=int, default=2048, help="length of the shared system prompts")
    ap.add_argument("--device-pages", type=int, default=None,
                    help="tier-1 (HBM) pages (default: a quarter of the working set, so KV spills)")
    ap.add_argument("--host-pages", type=int, default=None,
                    help="tier-2 (DRAM) pages (default: --hicache-ratio x device pages)")
    ap.add_argument("--hicache-ratio", type=float, default=2.0,
                    help="host pages per device page when --host-pages is not given (SGLang's default: 2)")
    ap.add_argument("--png", default="radixtier-demo.png", help="plot of TTFT (measured and predicted) and reuse "
                    "per tier ('' for none)")
    ap.add_argument("--namespace", default=None, help="tier-3 namespace file or device (default: a temp file)")
    ap.add_argument("--force", action="store_true", help="let the demo clear a --namespace that holds pages")
    ap.add_argument("--storage-bytes", type=int, default=512 << 20, help="size of a new namespace file")
    ap.add_argument("--quick", action="store_true", help="a smaller workload (about a minute)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")


def _workloads(a: argparse.Namespace) -> Dict[str, list]:
    """More sessions and agent types than the memory tiers hold, so part of the KV comes back from tier 3."""
    sys_tokens = a.system_tokens // (2 if a.quick else 1)
    sessions, turns, agents = (12, 3, 10) if a.quick else (a.sessions, a.turns, a.agents)
    types = max(1, agents // 2)  # two agents share each system prompt
    return {
        "multi-turn chat": multi_turn_chat(sessions, turns, sys_tokens // 2, 96, 64, seed=11),
        "agent fleet": agent_types(types, max(1, agents // types), 2, sys_tokens, 192, 96, seed=12),
    }


def tier_sizes(sessions: list, page_size: int) -> Tuple[int, int]:
    """(device pages, working set pages) for one workload: the device holds two of the longest
    requests (the running one and the one prefetched behind it) with room to spare, or a quarter
    of the working set, whichever is more; the host holds --hicache-ratio times that (SGLang's
    default 2), and what neither holds lives only in tier 3."""
    pages = set()
    longest = 0
    for session in sessions:
        for req in session:
            n = len(req.tokens) // page_size
            longest = max(longest, n)
            link = None
            for i in range(n):  # a page is its tokens plus everything before it: chain the identities
                link = hash((link, tuple(req.tokens[i * page_size:(i + 1) * page_size])))
                pages.add(link)
    working = len(pages)
    return max(2 * longest + 16, working // 4), working


def _fmt_tiers(hits: Dict[str, int]) -> str:
    total = sum(hits.values())
    if not total:
        return "-"
    return " ".join(f"{k[0].upper()}{100 * v / total:.0f}%" for k, v in hits.items() if v)


def _plot(rows, png: str) -> None:
    """Per workload and path: measured vs predicted mean TTFT, and reuse per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{w}\n{p}" for w, p, _ in rows]
    xs = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar([x - 0.2 for x in xs], [s["ttft_mean_s"] * 1e3 for _, _, s in rows], 0.4, label="measured")
    ax1.bar([x + 0.2 for x in xs], [s["ttft_mean_predicted_s"] * 1e3 for _, _, s in rows], 0.4, label="planner")
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_ylabel("mean TTFT (ms)")
    ax1.set_title("TTFT: measured vs `radixtier plan`")
    ax1.legend()
    bottom = [0.0] * len(rows)
    for tier in ("device", "host", "storage"):
        vals = [100 * s["reuse_by_tier"][tier] for _, _, s in rows]
        ax2.bar(list(xs), vals, 0.6, bottom=bottom, label="tier 3" if tier == "storage" else tier)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(list(xs), labels, fontsize=8)
    ax2.set_ylabel("% of prompt tokens reused")
    ax2.set_title("reuse per tier")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def run_demo(a: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    model = ToyLlama(ModelSpec(a.model, page_size=a.page_size))
    model.prefill(list(range(1, 65)))  # warm up kernels before anything is timed
    ns = KVNamespace(f"toy-llama-{a.model}", str(model.dtype).replace("torch.", ""), "page_first", a.page_size)
    page_bytes = model.kv_bytes_per_token * a.page_size
    tmp = None
    path = a.namespace
    if path is not None and os.path.exists(path) and not a.force:
        probe = NvmeofPageStore(path, page_bytes, node_id="demo")
        held = len(probe)
        probe.close()
        if held:
            print(f"radixtier demo: --namespace {path} holds {held} pages; the demo clears it before each run. "
                  f"Pass --force to allow that, or leave --namespace out to use a temporary file.", file=sys.stderr)
            return 2
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="radixtier-demo-")
        path = os.path.join(tmp.name, "namespace.img")
    if not a.hicache_ratio > 0:
        print(f"radixtier demo: --hicache-ratio: expected a positive number, got {a.hicache_ratio}", file=sys.stderr)
        return 2
    workloads = _workloads(a)
    prefill_tps, prefill_fixed, prefix_cost = measure_prefill(model)
    print(f"radixtier demo: toy Llama '{a.model}' on {model.device} ({model.kv_bytes_per_token} KV bytes/token), "
          f"page {a.page_size} tokens = {page_bytes} bytes")
    print(f"tier 3: {path} (embedded: file namespace + in-process index)")
    tier_gbps = measure_read_gbps(os.path.dirname(os.path.abspath(path)), total_bytes=32 << 20,
                                  page_bytes=page_bytes)
    hw = MeasuredHardware(prefill_tps, prefill_fixed, prefix_cost, tier_gbps)
    print(f"measured for the planner: prefill {prefill_tps:.0f} tokens/s + {prefill_fixed * 1e3:.1f} ms per request "
          f"+ {prefix_cost * 1e6:.1f} us per reused token, tier-3 verified reads {tier_gbps:.2f} GB/s")
    report: Dict[str, object] = {"model": a.model, "page_bytes": page_bytes, "workloads": {},
                                 "measured": {"prefill_tps": prefill_tps, "prefill_overhead_s": prefill_fixed,
                                              "prefix_cost_s_per_token": prefix_cost, "tier_gbps": tier_gbps}}
    rows = []
    total = 2 * sum(len(s) for w in workloads.values() for s in w)
    bar = tqdm(total=total, desc="serving", unit="req", file=sys.stderr)
    try:
        for wname, sessions in workloads.items():
            auto, working = tier_sizes(sessions, a.page_size)
            device_pages = a.device_pages or auto
            host_pages = a.host_pages or max(1, int(round(a.hicache_ratio * device_pages)))
            tqdm.write(f"{wname}: working set {working} pages; device {device_pages}, host {host_pages} pages",
                       file=sys.stderr)
            per_path: Dict[str, Dict[str, object]] = {}
            firsts: Dict[str, Dict[tuple, int]] = {}
            for pname in ("recompute", "radixtier"):
                bar.set_postfix_str(f"{wname} / {pname}")
                store = cache = None
                if pname == "recompute":
                    path_impl = RecomputePath()
                else:
                    store = NvmeofPageStore(path, page_bytes, create_bytes=a.storage_bytes, node_id="demo")
                    store.clear()
                    cfg = CacheConfig(page_size=a.page_size, page_shape=model.page_shape, dtype=model.dtype,
                                      device_pages=device_pages, host_pages=host_pages,
                                      device=str(model.device), write_policy="write_through",
                                      prefetch_policy="wait_complete")
                    cache = TieredKVCache(cfg, ns, store=store, index=InProcessIndex("demo"))
                    path_impl = TieredPath(cache)
                results, wall = serve(model, path_impl, sessions, a.concurrency, on_done=lambda r: bar.update(1),
                                      prefetch_window=1)
                s = summarize(results, wall)
                s["ttft_mean_predicted_s"] = predicted_mean_ttft(results, hw, model.kv_bytes_per_token, a.concurrency)
                s["reuse_by_tier"] = reuse_by_tier(s)
                if cache is not None:
                    s["cache"] = cache.stats()
                    cache.close()
                    store.close()
                per_path[pname] = s
                firsts[pname] = {(r.session, r.turn): r.first_token for r in results}
            rec, rt = per_path["recompute"], per_path["radixtier"]
            same = sum(firsts["radixtier"][k] == v for k, v in firsts["recompute"].items())
            speed = {"ttft_p50_speedup": rec["ttft_p50_s"] / rt["ttft_p50_s"],
                     "ttft_p99_speedup": rec["ttft_p99_s"] / rt["ttft_p99_s"],
                     "throughput_gain": rt["throughput_rps"] / rec["throughput_rps"],
                     "first_tokens_identical": f"{same}/{len(firsts['recompute'])}"}
            report["workloads"][wname] = {"paths": per_path, "radixtier_vs_recompute": speed,
                                          "tiers": {"device_pages": device_pages, "host_pages": host_pages,
                                                    "working_set_pages": working}}
            for pname, s in per_path.items():
                rows.append((wname, pname, s))
    finally:
        bar.close()
        if tmp is not None:
            tmp.cleanup()
    print()
    print(f"{'workload':16s} {'path':10s} {'reqs':>4s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'mean':>7s} {'planner':>8s} "
          f"{'error':>6s} {'req/s':>6s} {'reused':>6s} {'device':>6s} {'host':>6s} {'tier 3':>6s}")
    errors = []
    for wname, pname, s in rows:
        err = s["ttft_mean_predicted_s"] / s["ttft_mean_s"] - 1
        errors.append(err)
        rb = s["reuse_by_tier"]
        print(f"{wname:16s} {pname:10s} {s['requests']:4d} {s['ttft_p50_s'] * 1e3:7.0f}ms {s['ttft_p99_s'] * 1e3:7.0f}ms "
              f"{s['ttft_mean_s'] * 1e3:5.0f}ms {s['ttft_mean_predicted_s'] * 1e3:6.0f}ms {100 * err:+5.0f}% "
              f"{s['throughput_rps']:6.2f} {100 * s['hit_rate']:5.1f}% {100 * rb['device']:5.1f}% "
              f"{100 * rb['host']:5.1f}% {100 * rb['storage']:5.1f}%")
    print("(mean: measured mean TTFT; planner: `radixtier plan`'s model fed this run's measured prefill rate, "
          "tier-3 bandwidth, concurrency and reuse; error: planner / measured - 1; reuse columns: share of "
          "prompt tokens each tier served)")
    report["planner_error"] = {"max_abs": max(abs(e) for e in errors) if errors else None, "errors": errors}
    print()
    for wname, w in report["workloads"].items():
        sp = w["radixtier_vs_recompute"]
        print(f"{wname}: radixtier TTFT p50 {sp['ttft_p50_speedup']:.1f}x faster, p99 {sp['ttft_p99_speedup']:.1f}x, "
              f"throughput {sp['throughput_gain']:.2f}x vs recompute; first tokens identical {sp['first_tokens_identical']}")
    if a.png:
        _plot(rows, a.png)
        print(f"plot written to {a.png}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"figures written to {a.json}")
    return 0
