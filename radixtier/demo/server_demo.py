"""`radixtier demo`: SGLang's real server with radixtier as its L3 backend, against recompute.

Two `sglang.launch_server` processes with the same flags, one after the other: one with radixtier on
the embedded default (a file namespace, the in-process index), one with no L3 (a prefix that left
SGLang's device and host tiers is recomputed). Each serves a multi-turn chat and an agent fleet
over the OpenAI API: first the conversations' history ("first visit"), then users and agents
coming back for one more turn once their history has left device and host -- emptied by
`/flush_cache` ("after flush") or by a restart of the server ("after restart"); each phase has
conversations of its own. The figures are the client's TTFT and throughput and SGLang's own
account of where each prompt's tokens came from (device, host, storage); every greedy answer of the
radixtier server is checked against the recompute server's.

On a machine without CUDA the servers run through radixtier's CPU support layer
(`radixtier.integrations.sglang.cpu_support`); `--device cuda` runs SGLang as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Tuple

from radixtier.demo import http_load
from radixtier.demo.hf_model import WIDE_MLP, write_model
from radixtier.integrations.sglang.cpu_support import cuda_present
from radixtier.integrations.sglang.server import SGLangServer, hicache_args, radixtier_args, stop_servers_on_sigterm

RETURNING = ("after flush", "after restart")
PHASES = ("first visit",) + RETURNING
SETTLE_S = 2.0  # after the history: SGLang's backup thread writes the last requests' pages
PATHS = ("recompute", "radixtier")
LOGPROB_TOL = 0.02  # measured: up to 0.008 between a cached and a recomputed prefix of the wide-MLP model


def add_server_demo_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about two minutes on two cores; "
                                                           "the default run takes about four)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where SGLang runs the model (auto: cuda when present); cpu uses radixtier's CPU support layer")
    ap.add_argument("--concurrency", type=int, default=2, help="clients sending requests at once (default 2)")
    ap.add_argument("--hicache-ratio", type=float, default=2.0,
                    help="SGLang's host tier size as a multiple of the device tier (default 2, SGLang's default)")
    ap.add_argument("--namespace", default=None,
                    help="tier-3 namespace file (default: a temporary file); one that holds pages is replaced "
                         "only with --force")
    ap.add_argument("--force", action="store_true", help="let the demo replace a --namespace that holds pages")
    ap.add_argument("--capacity", default="1GiB", help="size of the namespace the demo creates (default 1GiB)")
    ap.add_argument("--logs", default=None, help="keep the servers' logs in this folder (default: a temporary "
                                                 "folder; a server that fails to start prints its log's tail)")
    ap.add_argument("--png", default="radixtier-demo.png", help="plot of TTFT and reuse per tier ('' for none)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _workloads(quick: bool) -> Dict[str, Dict[str, List[http_load.Conversation]]]:
    """Workload -> returning phase -> its own conversations (seeded: both servers get the same)."""
    def chat(seed):
        return http_load.multi_turn_chat(2, 3, 1500, 200, 100, seed) if quick else \
            http_load.multi_turn_chat(4, 4, 2500, 300, 150, seed)

    def agents(seed):
        return http_load.agent_fleet(1, 2, 2, 2000, 150, 150, seed) if quick else \
            http_load.agent_fleet(2, 3, 2, 3500, 200, 300, seed)

    return {"multi-turn chat": {"after flush": chat(101), "after restart": chat(102)},
            "agent fleet": {"after flush": agents(201), "after restart": agents(202)}}


def _prepare_namespace(path: str, force: bool) -> None:
    """An empty namespace is used as it is; one that holds pages (or is not a radixtier namespace) is
    replaced only with --force, and only when it is a file (the demo creates its namespace as one)."""
    if not os.path.exists(path):
        return
    from radixtier.storage.nvmeof.inspect import inspect_namespace

    try:
        used = inspect_namespace(path)["used"]
    except (OSError, ValueError):
        used = None
    if used == 0:
        return
    if not force:
        what = f"holds {used} pages" if used else "is not a radixtier namespace"
        raise ValueError(f"--namespace: {path} {what}; pass --force to let the demo replace it, or leave "
                         f"--namespace out to use a temporary file")
    if not os.path.isfile(path):
        raise ValueError(f"--namespace: {path} is not a regular file; the demo creates its namespace as a file")
    os.remove(path)


def returning_users(s: SGLangServer, plan: Mapping[Tuple[str, str, int], List[http_load.Conversation]], *,
                    history_concurrency: int, on_step: Callable[[str], None] = lambda _what: None
                    ) -> Tuple[Dict[Tuple, http_load.Run], Dict[Tuple, http_load.Run]]:
    """Serve every cell's history, then each cell's returning turn once that history has left SGLang's
    device and host tiers (by /flush_cache before each cell, or by one restart for all the cells of
    that phase). plan: (workload, phase in RETURNING, concurrency) -> the cell's own conversations,
    which share no prefix with another cell's. Returns (history run, returning run) per cell.
    The demo and bench/sglang_server.py both measure through this."""
    history = {}
    for key, convs in plan.items():
        on_step(f"{key[0]}, history")
        history[key] = http_load.replay(s.url, http_load.split_last_turn(convs)[0], concurrency=history_concurrency)
    time.sleep(SETTLE_S)  # the last requests' backups land before the tiers are emptied
    returning = {}
    for phase in RETURNING:
        if phase == "after restart":
            on_step("restarting SGLang")
            s.restart()
        for key, convs in plan.items():
            if key[1] != phase:
                continue
            if phase == "after flush":
                s.flush_cache()
            on_step(f"{key[0]}, {phase}")
            returning[key] = http_load.replay(s.url, http_load.split_last_turn(convs)[1], concurrency=key[2])
    return history, returning


def run_server_demo(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    stop_servers_on_sigterm()
    device = ("cuda" if cuda_present() else "cpu") if a.device == "auto" else a.device
    if device == "cpu" and a.device == "cpu" and cuda_present():
        raise ValueError("--device cpu: this machine has CUDA, and radixtier's CPU support layer runs SGLang only "
                         "where CUDA is absent; use --device cuda (or auto)")
    if a.concurrency < 1:
        raise ValueError(f"--concurrency: expected a positive integer, got {a.concurrency}")
    if not a.hicache_ratio > 1:
        raise ValueError(f"--hicache-ratio: SGLang needs a host tier larger than the device's, got {a.hicache_ratio}")
    tmp = tempfile.mkdtemp(prefix="radixtier-demo-")
    try:
        path = a.namespace or os.path.join(tmp, "namespace.img")
        _prepare_namespace(path, a.force)
        logs = a.logs or os.path.join(tmp, "logs")
        spec = WIDE_MLP
        model = write_model(os.path.join(tmp, "toy-llama"), spec)
        loads = _workloads(a.quick)
        longest = max(http_load.prompt_tokens(t) for w in loads.values() for convs in w.values() for c in convs
                      for t in c.turns)
        # the device holds a few of the longest prompts: what the history leaves behind spills to host and tier 3
        device_tokens = 64 * (max(4, a.concurrency + 2) * longest // 64 + 1)
        common = ["--page-size", "64", "--max-total-tokens", str(device_tokens), "--enable-cache-report",
                  "--log-level", "warning"]
        print(f"radixtier demo: SGLang's real server ({'CPU, radixtier CPU support layer' if device == 'cpu' else 'CUDA'}),"
              f" toy Llama ({spec.layers} layers, hidden {spec.hidden}, MLP {spec.intermediate}, random weights, {spec.kv_bytes_per_token} "
              f"KV bytes/token), 64-token pages; device tier {device_tokens} tokens, host {a.hicache_ratio:g}x")
        print(f"tier 3: {path} (radixtier's embedded default: file namespace + in-process index)")
        plan = {(w, phase, a.concurrency): convs for w, phases in loads.items() for phase, convs in phases.items()}
        bar = tqdm(total=len(PATHS) * (2 + 2 * len(plan)), desc="demo", unit="step", file=sys.stderr)
        results: Dict[str, Dict[str, Dict[str, http_load.Run]]] = {w: {p: {} for p in PHASES} for w in loads}
        startup: Dict[str, float] = {}
        try:
            for pname in PATHS:
                if pname == "radixtier":
                    args = radixtier_args(path, capacity=a.capacity, node_id="demo", ratio=a.hicache_ratio,
                                          device=device)
                else:
                    args = hicache_args(extra_config=None, backend="", ratio=a.hicache_ratio, device=device)
                s = SGLangServer(model, common + args, log_path=os.path.join(logs, f"{pname}.log"), device=device)

                def step(what: str, pname: str = pname) -> None:
                    bar.set_postfix_str(f"{pname}: {what}")
                    bar.update()

                step("starting SGLang")
                with s:
                    startup[pname] = s.startup_s
                    history, returning = returning_users(s, plan, history_concurrency=a.concurrency, on_step=step)
                for (w, phase, _c), run in returning.items():
                    results[w][phase][pname] = run
                for w in loads:
                    firsts = [run for (hw, _p, _c), run in history.items() if hw == w]
                    results[w]["first visit"][pname] = http_load.Run([r for run in firsts for r in run.replies],
                                                                    sum(run.wall_s for run in firsts))
        finally:
            bar.close()
        report = _report(results, startup, device, device_tokens, a)
        if a.png:
            _plot(results, a.png)
            print(f"plot written to {a.png}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"figures written to {a.json}")
        return 0 if report["all_identical"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model, a temporary namespace, logs unless --logs


def _report(results, startup, device, device_tokens, a) -> Dict[str, object]:
    print()
    print(f"{'workload':16s} {'phase':14s} {'path':10s} {'reqs':>4s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'req/s':>6s}   "
          f"prompt tokens served from: {'device':>7s} {'host':>7s} {'tier 3':>7s} {'computed':>8s}")
    out: Dict[str, object] = {"device": device, "device_tokens": device_tokens, "concurrency": a.concurrency,
                              "server_startup_s": startup, "workloads": {}}
    all_same = True
    lines = []
    for wname, phases in results.items():
        for phase, paths in phases.items():
            for pname, run in paths.items():
                s = run.summary()
                computed = 1 - s["device_share"] - s["host_share"] - s["storage_share"]
                print(f"{wname:16s} {phase:14s} {pname:10s} {s['requests']:4d} {s['ttft_p50_s'] * 1e3:7.0f}ms "
                      f"{s['ttft_p99_s'] * 1e3:7.0f}ms {s['throughput_rps']:6.2f}   {'':26s}"
                      f"{100 * s['device_share']:6.1f}% {100 * s['host_share']:6.1f}% {100 * s['storage_share']:6.1f}% "
                      f"{100 * computed:7.1f}%")
                out["workloads"].setdefault(wname, {}).setdefault(phase, {})[pname] = s
            rec, rt = paths["recompute"], paths["radixtier"]
            agree = http_load.agreement(rec, rt, logprob_tol=LOGPROB_TOL, near_tie=LOGPROB_TOL)
            all_same &= not agree["differ"]
            srec, srt = rec.summary(), rt.summary()
            speed = {"ttft_p50_speedup": srec["ttft_p50_s"] / srt["ttft_p50_s"],
                     "ttft_p99_speedup": srec["ttft_p99_s"] / srt["ttft_p99_s"],
                     "throughput_gain": srt["throughput_rps"] / srec["throughput_rps"],
                     "answers_identical": f"{len(agree['identical'])}/{len(rt.replies)}",
                     "answers_parted_at_a_tie": agree["ties"], "answers_differ": agree["differ"]}
            out["workloads"][wname][phase]["radixtier_vs_recompute"] = speed
            if phase != "first visit":
                lines.append(f"{wname}, {phase}: radixtier TTFT p50 {speed['ttft_p50_speedup']:.1f}x faster, p99 "
                             f"{speed['ttft_p99_speedup']:.1f}x, throughput {speed['throughput_gain']:.2f}x vs recompute; "
                             f"{100 * srt['storage_share']:.0f}% of prompt tokens from tier 3; greedy answers "
                             f"identical {speed['answers_identical']}"
                             + (f" ({len(agree['ties'])} parted at a near-tie)" if agree["ties"] else ""))
    print("(TTFT: first streamed token as the client sees it; the shares are SGLang's own cached_tokens_details)")
    print()
    for line in lines:
        print(line)
    out["all_identical"] = all_same
    print(f"(identical: every greedy token equal and its logprob within {LOGPROB_TOL} of recompute's; bf16 "
          f"matmuls over a cached prefix round differently from a full prefill)")
    if not all_same:
        print("radixtier demo: some answers differ from recompute (see --json)", file=sys.stderr)
    return out


def _plot(results, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(w, p) for w, phases in results.items() for p in phases]
    labels = [f"{w}\n{p}" for w, p in cells]
    xs = range(len(cells))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, pname in enumerate(PATHS):
        ax1.bar([x + (i - 0.5) * 0.4 for x in xs],
                [results[w][p][pname].summary()["ttft_p50_s"] * 1e3 for w, p in cells], 0.4, label=pname)
    ax1.set_xticks(list(xs), labels, fontsize=7)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title("TTFT through SGLang's real server")
    ax1.legend()
    bottom = [0.0] * len(cells)
    for tier, label in (("device", "device"), ("host", "host"), ("storage", "tier 3 (radixtier)")):
        vals = [100 * results[w][p]["radixtier"].summary()[f"{tier}_share"] for w, p in cells]
        ax2.bar(list(xs), vals, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(list(xs), labels, fontsize=7)
    ax2.set_ylabel("% of prompt tokens (SGLang's cached_tokens_details)")
    ax2.set_title("radixtier server: where prompt tokens came from")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
