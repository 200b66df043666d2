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
from typing import Dict, List, Tuple

import torch
from tqdm import tqdm

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace
from radixtier.demo.serving import RecomputePath, RequestResult, TieredPath, serve, summarize
from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.storage.index.inprocess import InProcessIndex
from radixtier.demo.toymodel import SIZES, ModelSpec, ToyLlama
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
                    help="tier-2 (DRAM) pages (default: a quarter of the working set, so tier 3 serves the rest)")
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
    """(pages per memory tier, working set pages) for one workload: each of device and host holds
    two of the longest requests (the running one and the one prefetched behind it) with room to
    spare, or a quarter of the working set, whichever is more; the rest lives only in tier 3."""
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
    workloads = _workloads(a)
    print(f"radixtier demo: toy Llama '{a.model}' on {model.device} ({model.kv_bytes_per_token} KV bytes/token), "
          f"page {a.page_size} tokens = {page_bytes} bytes")
    print(f"tier 3: {path} (embedded: file namespace + in-process index)")
    report: Dict[str, object] = {"model": a.model, "page_bytes": page_bytes, "workloads": {}}
    rows = []
    total = 2 * sum(len(s) for w in workloads.values() for s in w)
    bar = tqdm(total=total, desc="serving", unit="req", file=sys.stderr)
    try:
        for wname, sessions in workloads.items():
            auto, working = tier_sizes(sessions, a.page_size)
            device_pages, host_pages = a.device_pages or auto, a.host_pages or auto
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
    print(f"{'workload':16s} {'path':10s} {'reqs':>4s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'req/s':>6s} "
          f"{'reused':>6s}  tiers (reused tokens)")
    for wname, pname, s in rows:
        print(f"{wname:16s} {pname:10s} {s['requests']:4d} {s['ttft_p50_s'] * 1e3:7.0f}ms {s['ttft_p99_s'] * 1e3:7.0f}ms "
              f"{s['throughput_rps']:6.2f} {100 * s['hit_rate']:5.1f}%  {_fmt_tiers(s['hit_tokens_by_tier'])}")
    print()
    for wname, w in report["workloads"].items():
        sp = w["radixtier_vs_recompute"]
        print(f"{wname}: radixtier TTFT p50 {sp['ttft_p50_speedup']:.1f}x faster, p99 {sp['ttft_p99_speedup']:.1f}x, "
              f"throughput {sp['throughput_gain']:.2f}x vs recompute; first tokens identical {sp['first_tokens_identical']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(f"figures written to {a.json}")
    return 0
