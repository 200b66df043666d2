"""TTFT benchmark: the three paths the field compares, on the same workload, in one run.

  recompute   no KV reuse: every request prefills its whole prompt
  local-disk  the same device and host tiers over a naive tier 3 (one file per page, serial
              buffered reads in the request's critical path: SGLang's HiCacheFile, LMCache
              before its parallel-read patch)
  radixtier   the same tiers over radixtier's NVMe-oF page store (parallel, coalesced O_DIRECT
              reads, prefetch started when the request arrives)

The model is a small Llama-style transformer with random weights (transformers, no download),
on CUDA when present (device<->host copies then run on CUDA streams), else the CPU. Context
lengths go up to 16K tokens, concurrency 1, 8 and 16. The workload is long-context chat:
each session has a shared system prompt, its own long document and several turns, so the KV
working set is larger than the device and host tiers together and comes back from tier 3.

A capacity-bounded run then makes tier 3 smaller than the working set and compares
prefix-aware (leaves-first) eviction with per-page LRU on hit rate and TTFT.

    .venv/bin/python bench/ttft.py            # full run (several minutes on 2 CPU cores)
    .venv/bin/python bench/ttft.py --quick    # a short run

Writes bench/results/ttft.json, ttft.md and ttft_*.png. Ratios are measured side by side in
one run, which is what this noisy machine allows; absolute times are the toy model's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from radixtier.testing.naive_store import OneFilePerPageStore  # noqa: E402

from radixtier.cache import CacheConfig, TieredKVCache  # noqa: E402
from radixtier.hashing import KVNamespace  # noqa: E402
from radixtier.demo.serving import RecomputePath, TieredPath, serve, summarize  # noqa: E402
from radixtier.demo.stats import percentile  # noqa: E402
from radixtier.storage.nvmeof.store import NvmeofPageStore  # noqa: E402
from radixtier.storage.index.inprocess import InProcessIndex  # noqa: E402
from radixtier.demo.toymodel import SIZES, ModelSpec, ToyLlama  # noqa: E402
from radixtier.demo.workloads import Session, agent_types, document_chat  # noqa: E402

PATHS = ("recompute", "local-disk", "radixtier")
SEEDS = {"ttft_reduction_vs_local_disk": (0.26, 0.32), "throughput_gain_vs_local_disk": (0.29, 0.40),
         "recompute_over_radixtier_ttft": (8.6, 20.0)}
USER, REPLY = 128, 128


@dataclass
class Scenario:
    name: str
    concurrency: int
    context: int  # tokens in a session's last prompt
    sessions: int
    turns: int


def scenarios(quick: bool) -> List[Scenario]:
    if quick:
        return [Scenario("c1-2K", 1, 2048, 12, 3), Scenario("c8-2K", 8, 2048, 12, 3),
                Scenario("c16-2K", 16, 2048, 16, 2), Scenario("c8-8K", 8, 8192, 12, 2)]
    return [Scenario("c1-4K", 1, 4096, 12, 3), Scenario("c8-4K", 8, 4096, 12, 3), Scenario("c16-4K", 16, 4096, 16, 3),
            Scenario("c8-1K", 8, 1024, 12, 3), Scenario("c8-16K", 8, 16384, 12, 3)]


def workload(sc: Scenario, seed: int = 7, system_share: float = 0.0) -> List[Session]:
    system = int(sc.context * system_share) if system_share else min(1024, sc.context // 8)
    document = sc.context - system - sc.turns * USER - (sc.turns - 1) * REPLY
    if document <= 0:
        raise ValueError(f"context: {sc.context} tokens is too short for {sc.turns} turns")
    return document_chat(sc.sessions, sc.turns, system, document, USER, REPLY, seed=seed)


@dataclass
class CapacityCase:
    """Tier 3 smaller than what the workload writes: leaves-first against per-page LRU."""

    scenario: Scenario
    what: str
    types: int
    system_tokens: int
    task_tokens: int
    observation_tokens: int
    storage_fraction: float = 0.7

    def __post_init__(self) -> None:
        per = self.scenario.sessions // self.types
        self.sessions = agent_types(self.types, per, self.scenario.turns, self.system_tokens, self.task_tokens,
                                    self.observation_tokens, seed=9)

    def unique_pages(self, page: int) -> int:
        tail = self.task_tokens + (self.scenario.turns - 1) * self.observation_tokens
        return (self.types * self.system_tokens + self.scenario.sessions * tail) // page


def capacity_cases(quick: bool) -> List[CapacityCase]:
    k = 1 if quick else 4  # full run: 4-8K-token prompts, long enough for a tier-3 hit to beat recompute here
    many = CapacityCase(Scenario("cap-8-types", 8, 1024 * k + 512 + 256, 16, 3),
                        "8 agent types: their prompts do not fit the upper tiers", 8, 1024 * k, 512, 128)
    few = CapacityCase(Scenario("cap-4-types", 8, 2048 * k + 512 + 256, 16, 3),
                       "4 agent types: their prompts stay in the upper tiers", 4, 2048 * k, 512, 128)
    return [many, few]


def tier_pages(sc: Scenario, page: int) -> Tuple[int, int, int]:
    """(device, host, working set) pages: the tiers hold a few requests, the working set is bigger."""
    ctx_pages = sc.context // page + 2
    working = sc.sessions * ctx_pages
    # room for the running request, the prefetched next one and the spill between them
    device = max(3 * ctx_pages + 16, working // 8)
    host = max(4 * ctx_pages + 16, working // 4)
    return device, host, working


class EmulatedKVPath(TieredPath):
    """TieredPath whose pages carry `extra` ballast elements after the model's own KV.

    The toy model's KV is ~1 KiB/token; a 480B-class model's is ~250 KiB/token against far more
    compute per token. Ballast makes the bytes each tier moves per token of compute closer to
    that, so tier-3 software shows up in TTFT as it does in production; the model still runs
    on its real KV (the ballast is stripped before prefill), so first tokens stay checkable.
    """

    def __init__(self, cache: TieredKVCache, model: ToyLlama, extra: int, **kw) -> None:
        super().__init__(cache, model_page_shape=model.page_shape, **kw)  # the model reads its own KV only
        self.extra = extra
        self._ballast = torch.randn(extra, generator=torch.Generator().manual_seed(5)).to(model.dtype)

    def save(self, loaded, tokens, pages, first_page) -> None:
        n = pages.shape[0]
        if n:
            ballast = self._ballast.to(pages.device).expand(n, self.extra)
            super().save(loaded, tokens, torch.cat([pages.reshape(n, -1), ballast], dim=1), first_page)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        device = a.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to torch on this machine")
        self.device = device
        self.model = ToyLlama(ModelSpec(a.model, page_size=a.page_size, device=device))
        self.model.prefill(list(range(1, 2 * a.page_size + 1)))  # warm kernels
        self.ns = KVNamespace(f"toy-llama-{a.model}", str(self.model.dtype).replace("torch.", ""), "page_first",
                              a.page_size)
        own = self.model.kv_bytes_per_token
        per_token = max(own, a.kv_bytes_per_token or own)
        elem = self.model.dtype.itemsize
        self.extra = (per_token - own) * a.page_size // elem  # ballast elements per page
        self.page_elems = self.model.kv_bytes_per_token * a.page_size // elem + self.extra
        self.page_bytes = self.page_elems * elem
        self.kv_bytes_per_token = self.page_bytes // a.page_size
        self.work = tempfile.mkdtemp(prefix="radixtier-ttft-", dir=a.workdir)

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)

    def _cache(self, sc: Scenario, store, io_workers: int, device_pages: int, host_pages: int) -> TieredKVCache:
        shape = (self.page_elems,) if self.extra else self.model.page_shape
        cfg = CacheConfig(page_size=self.a.page_size, page_shape=shape, dtype=self.model.dtype,
                          device_pages=device_pages, host_pages=host_pages, device=self.device,
                          write_policy="write_through", prefetch_policy="wait_complete", io_workers=io_workers)
        index = InProcessIndex("bench") if isinstance(store, NvmeofPageStore) else None
        return TieredKVCache(cfg, self.ns, store=store, index=index)

    def _path(self, cache: TieredKVCache, name: str, **kw) -> TieredPath:
        if self.extra:
            return EmulatedKVPath(cache, self.model, self.extra, name=name, **kw)
        return TieredPath(cache, name, **kw)

    def run_path(self, kind: str, sc: Scenario, sessions: List[Session], bar, storage_pages: Optional[int] = None,
                 eviction: str = "leaves_first") -> Tuple[Dict[str, object], Dict[tuple, int]]:
        """One run of one path: its summary and first tokens."""
        return summarize_runs([self.run_once(kind, sc, sessions, bar, storage_pages, eviction)])

    def run_once(self, kind: str, sc: Scenario, sessions: List[Session], bar, storage_pages: Optional[int] = None,
                 eviction: str = "leaves_first") -> "Run":
        device_pages, host_pages, working = tier_pages(sc, self.a.page_size)
        storage_pages = storage_pages or working + 64
        store = cache = None
        if kind == "recompute":
            impl = RecomputePath()
        elif kind == "local-disk":
            d = os.path.join(self.work, f"files-{sc.name}-{eviction}")
            shutil.rmtree(d, ignore_errors=True)
            store = OneFilePerPageStore(d, self.page_bytes, storage_pages, eviction=eviction)
            # The same mover threads as radixtier (reads never queue behind write-through puts);
            # the store itself keeps one reader and one writer, as HiCacheFile does.
            cache = self._cache(sc, store, 4, device_pages, host_pages)
            impl = self._path(cache, kind, prefetch_on_arrival=False)
        else:
            f = os.path.join(self.work, f"ns-{sc.name}-{eviction}.img")
            if os.path.exists(f):
                os.remove(f)
            slot = self.page_bytes + 4096
            store = NvmeofPageStore(f, self.page_bytes, create_bytes=storage_pages * slot + (8 << 20),
                                    node_id="bench", eviction=eviction, queue_depth=self.a.queue_depth)
            cache = self._cache(sc, store, 4, device_pages, host_pages)
            impl = self._path(cache, kind)
        try:
            results, wall = serve(self.model, impl, sessions, sc.concurrency, on_done=lambda r: bar.update(1),
                                  prefetch_window=self.a.prefetch_window)
        finally:
            if cache is not None:
                cache_stats = cache.stats()
                cache.close()
            if store is not None:
                store.close()
                if kind == "local-disk":  # a full run writes GiBs: free each path's pages when done
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    os.remove(f)
        tiers = {"device_pages": device_pages, "host_pages": host_pages,
                 "storage_pages": store.capacity_pages if store is not None else 0, "working_set_pages": working}
        return Run(results, wall, cache_stats if cache is not None else None, tiers)


@dataclass
class Run:
    results: list
    wall: float
    cache: Optional[Dict[str, object]]
    tiers: Dict[str, int]

    @property
    def firsts(self) -> Dict[tuple, int]:
        return {(r.session, r.turn): r.first_token for r in self.results}


def summarize_runs(runs: List[Run]) -> Tuple[Dict[str, object], Dict[tuple, int]]:
    """Repeated runs of one path as one sample: percentiles over every request, throughput over
    the summed wall time, and each run's p50 to show the spread."""
    results = [r for run in runs for r in run.results]
    s = summarize(results, sum(run.wall for run in runs))
    warm = [r.ttft_s for r in results if r.turn > 0]
    s["warm_ttft_p50_s"] = percentile(warm, 50)
    s["warm_ttft_p99_s"] = percentile(warm, 99)
    s["repeats"] = len(runs)
    s["ttft_p50_s_each_run"] = [percentile([r.ttft_s for r in run.results], 50) for run in runs]
    if runs[-1].cache is not None:
        s["cache"] = runs[-1].cache
    s["tiers"] = runs[-1].tiers
    return s, runs[0].firsts


def ratios(per_path: Dict[str, Dict[str, object]]) -> Dict[str, float]:
    rec, naive, rt = per_path["recompute"], per_path["local-disk"], per_path["radixtier"]
    return {
        "ttft_reduction_vs_local_disk": 1 - rt["ttft_p50_s"] / naive["ttft_p50_s"],
        "warm_ttft_reduction_vs_local_disk": 1 - rt["warm_ttft_p50_s"] / naive["warm_ttft_p50_s"],
        "throughput_gain_vs_local_disk": rt["throughput_rps"] / naive["throughput_rps"] - 1,
        "recompute_over_radixtier_ttft": rec["ttft_p50_s"] / rt["ttft_p50_s"],
        "recompute_over_radixtier_warm_ttft": rec["warm_ttft_p50_s"] / rt["warm_ttft_p50_s"],
        "recompute_over_local_disk_ttft": rec["ttft_p50_s"] / naive["ttft_p50_s"],
    }


def tier_split(s: Dict[str, object]) -> str:
    hits = s.get("hit_tokens_by_tier") or {}
    total = sum(hits.values())
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in hits.items() if v) if total else "-"


def markdown(report: Dict[str, object]) -> str:
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    out = [f"# TTFT benchmark ({report['model']} model on {report['device']}, page {report['page_size']} tokens = "
           f"{report['page_bytes']} bytes: {report['kv_bytes_per_token']} KV bytes/token moved, of which the "
           f"model's own {report['model_kv_bytes_per_token']})", "",
           f"Each path ran {report.get('repeat', 1)} time(s), in alternating order; percentiles pool every request.", "",
           "| scenario | path | reqs | TTFT p50 ms | TTFT p99 ms | warm p50 ms | req/s | reused | reused from |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, sc in report["scenarios"].items():
        for p, s in sc["paths"].items():
            out.append(f"| {name} | {p} | {s['requests']} | {ms(s['ttft_p50_s'])} | {ms(s['ttft_p99_s'])} | "
                       f"{ms(s['warm_ttft_p50_s'])} | {s['throughput_rps']:.2f} | {100 * s['hit_rate']:.0f}% | "
                       f"{tier_split(s)} |")
    out += ["", "Ratios (radixtier against the others; seeds: TTFT -26..32% and throughput +29..40% vs local "
                "NVMe, 8.6..20x faster than recompute):", "",
            "| scenario | TTFT p50 vs local disk | warm TTFT p50 vs local disk | throughput vs local disk | "
            "recompute / radixtier TTFT p50 | warm | first tokens = recompute |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for name, sc in report["scenarios"].items():
        r = sc["ratios"]
        out.append(f"| {name} | {-100 * r['ttft_reduction_vs_local_disk']:+.0f}% | "
                   f"{-100 * r['warm_ttft_reduction_vs_local_disk']:+.0f}% | "
                   f"{100 * r['throughput_gain_vs_local_disk']:+.0f}% | {r['recompute_over_radixtier_ttft']:.1f}x | "
                   f"{r['recompute_over_radixtier_warm_ttft']:.1f}x | {sc['first_tokens_identical']} |")
    for name, cap in (report.get("capacity_bounded") or {}).items():
        out += ["", f"Capacity-bounded tier 3, {name} ({cap['what']}): {cap['storage_pages']} pages for "
                    f"{cap['unique_pages']} written, radixtier path:", "",
                "| tier-3 eviction | reused | reused from | TTFT p50 ms | TTFT p99 ms | warm p50 ms | req/s |",
                "|---|---:|---|---:|---:|---:|---:|"]
        for ev, s in cap["runs"].items():
            out.append(f"| {ev} | {100 * s['hit_rate']:.0f}% | {tier_split(s)} | {ms(s['ttft_p50_s'])} | "
                       f"{ms(s['ttft_p99_s'])} | {ms(s['warm_ttft_p50_s'])} | {s['throughput_rps']:.2f} |")
    return "\n".join(out) + "\n"


def plots(report: Dict[str, object], outdir: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    names = list(report["scenarios"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for ax, key, title in ((axes[0], "ttft_p50_s", "TTFT p50"), (axes[1], "warm_ttft_p50_s", "TTFT p50, warm turns")):
        for i, p in enumerate(PATHS):
            vals = [report["scenarios"][n]["paths"][p][key] * 1e3 for n in names]
            ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=p)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"TTFT by scenario (concurrency-context), {report['model']} model on {report['device']}")
    fig.tight_layout()
    files.append(os.path.join(outdir, "ttft_by_scenario.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, p in enumerate(PATHS):
        vals = [report["scenarios"][n]["paths"][p]["throughput_rps"] for n in names]
        ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=p)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("requests / s")
    ax.set_title("Throughput")
    ax.legend()
    fig.tight_layout()
    files.append(os.path.join(outdir, "ttft_throughput.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    caps = report.get("capacity_bounded") or {}
    if caps:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        names = list(caps)
        for i, ev in enumerate(("leaves_first", "lru")):
            xs = [x + (i - 0.5) * 0.4 for x in range(len(names))]
            axes[0].bar(xs, [100 * caps[n]["runs"][ev]["hit_rate"] for n in names], 0.4, label=ev)
            axes[1].bar(xs, [caps[n]["runs"][ev]["ttft_p50_s"] * 1e3 for n in names], 0.4, label=ev)
        for ax, label in ((axes[0], "prompt tokens reused (%)"), (axes[1], "TTFT p50 (ms)")):
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names)
            ax.set_ylabel(label)
            ax.legend()
        axes[0].set_title("Hit rate, tier 3 smaller than the working set")
        axes[1].set_title("TTFT")
        fig.tight_layout()
        files.append(os.path.join(outdir, "ttft_capacity_bounded.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--kv-bytes-per-token", type=int, default=16384,
                    help="KV bytes each tier moves per token (ballast after the model's own ~1 KiB; 0: the model's)")
    ap.add_argument("--prefetch-window", type=int, default=1, help="queued requests prefetched ahead (radixtier)")
    ap.add_argument("--quick", action="store_true", help="shorter contexts and fewer requests")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each path, in alternating order, pooled into one sample (this machine is noisy)")
    ap.add_argument("--no-capacity-run", action="store_true", help="skip the capacity-bounded eviction comparison")
    ap.add_argument("--only-capacity-run", action="store_true", help="run only the capacity-bounded comparison")
    ap.add_argument("--workdir", default=None, help="where the namespaces go (default: the temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    b = Bench(a)
    scs = [] if a.only_capacity_run else scenarios(a.quick)
    caps = capacity_cases(a.quick)
    loads = {sc.name: workload(sc) for sc in scs}
    if a.repeat < 1:
        ap.error(f"--repeat: expected a positive integer, got {a.repeat}")
    total = a.repeat * sum(len(PATHS) * sum(len(s) for s in loads[sc.name]) for sc in scs)
    if not a.no_capacity_run:
        total += a.repeat * 2 * sum(len(s) for c in caps for s in c.sessions)
    report: Dict[str, object] = {"model": a.model, "device": b.device, "page_size": a.page_size,
                                 "page_bytes": b.page_bytes, "kv_bytes_per_token": b.kv_bytes_per_token,
                                 "model_kv_bytes_per_token": b.model.kv_bytes_per_token,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "seeds": SEEDS, "repeat": a.repeat,
                                 "scenarios": {}}
    report["workdir_filesystem"] = filesystem_of(b.work)
    wrong: List[str] = []
    bar = tqdm(total=total, desc="ttft", unit="req", file=sys.stderr)
    try:
        for sc in scs:
            runs: Dict[str, List[Run]] = {p: [] for p in PATHS}
            for rep in range(a.repeat):  # alternate the order, so drift on this machine hits every path alike
                for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
                    bar.set_postfix_str(f"{sc.name} / {p}")
                    runs[p].append(b.run_once(p, sc, loads[sc.name], bar))
            per_path, firsts = {}, {}
            for p in PATHS:
                per_path[p], firsts[p] = summarize_runs(runs[p])
                if any(run.firsts != firsts[p] for run in runs[p]):
                    wrong.append(f"{sc.name}/{p}: first tokens differ between repeats")
            same = {p: sum(firsts[p][k] == v for k, v in firsts["recompute"].items()) for p in PATHS[1:]}
            for p in PATHS[1:]:
                if same[p] != len(firsts["recompute"]):
                    wrong.append(f"{sc.name}/{p}: {len(firsts['recompute']) - same[p]} first tokens differ from recompute")
            report["scenarios"][sc.name] = {
                "scenario": asdict(sc), "paths": per_path, "ratios": ratios(per_path),
                "first_tokens_identical": " ".join(f"{p} {same[p]}/{len(firsts['recompute'])}" for p in PATHS[1:])}
        if not a.no_capacity_run:
            report["capacity_bounded"] = {}
            for c in caps:
                storage = int(c.unique_pages(a.page_size) * c.storage_fraction)
                raw: Dict[str, List[Run]] = {"leaves_first": [], "lru": []}
                for rep in range(a.repeat):
                    for ev in (("leaves_first", "lru") if rep % 2 == 0 else ("lru", "leaves_first")):
                        bar.set_postfix_str(f"{c.scenario.name} / {ev}")
                        raw[ev].append(b.run_once("radixtier", c.scenario, c.sessions, bar, storage_pages=storage,
                                                  eviction=ev))
                runs, firsts = {}, {}
                for ev, rs in raw.items():
                    runs[ev], firsts[ev] = summarize_runs(rs)
                    if any(run.firsts != firsts[ev] for run in rs):
                        wrong.append(f"{c.scenario.name}/{ev}: first tokens differ between repeats")
                if firsts["leaves_first"] != firsts["lru"]:  # what is reused differs; the answers must not
                    wrong.append(f"{c.scenario.name}: first tokens differ between leaves_first and lru")
                report["capacity_bounded"][c.scenario.name] = {
                    "what": c.what, "storage_pages": runs["lru"]["tiers"]["storage_pages"],
                    "unique_pages": c.unique_pages(a.page_size), "runs": runs}
    finally:
        bar.close()
        b.close()
    with open(os.path.join(a.out, "ttft.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    md = markdown(report)
    with open(os.path.join(a.out, "ttft.md"), "w") as f:
        f.write(md)
    pngs = plots(report, a.out)
    print(md)
    print("written:", ", ".join([os.path.join(a.out, "ttft.json"), os.path.join(a.out, "ttft.md")] + pngs))
    if wrong:
        print("WRONG ANSWERS (a cached page changed a result):\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    return 0


def filesystem_of(path: str) -> str:
    """The filesystem type under `path` (tmpfs would make "disk" reads memory reads)."""
    best, fstype = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if os.path.join(os.path.abspath(path), "").startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, fstype = mnt, parts[2]
    return fstype


if __name__ == "__main__":
    sys.exit(main())
