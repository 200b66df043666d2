"""`radixtier demo`: SGLang's real server with radixtier as its L3 backend, against recompute.

Two `sglang.launch_server` processes with the same flags: one with radixtier on the embedded
default (a file namespace, the in-process index), one with no L3 (a prefix that left SGLang's device
and host tiers is recomputed). They start together; while one is measured the other is paused
(SIGSTOP: an idle SGLang scheduler polls without sleeping and would take a core). Each serves a
multi-turn chat and an agent fleet over the OpenAI API: first the conversations' history ("first
visit"), then users and agents coming back for one more turn -- after other traffic pushed their
history out of the device tier but not the host tier ("after other traffic": SGLang's L2 serves
it), after `/flush_cache` emptied device and host ("after flush": tier 3 serves it), and after a
restart of the server ("after restart": tier 3 again); each phase has conversations of its own.
The figures are the client's TTFT and throughput and SGLang's own account of where each prompt's
tokens came from (device, host, storage); every greedy answer of the radixtier server is checked
against the recompute server's.

The toy model computes in the CPU's native dtype (`radixtier.native_dtype`): bf16 where the CPU
has AVX-512 BF16 or AMX, fp32 elsewhere (bf16 in software is about 4x slower there).

On a machine without CUDA the servers run through radixtier's CPU support layer
(`radixtier.integrations.sglang.launch.cpu_support`); `--device cuda` runs SGLang as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from radixtier.demo import http_load
from radixtier.demo.hf_model import WIDE_MLP, write_model
from radixtier.integrations.sglang.launch.cpu_support import cuda_present
from radixtier.integrations.sglang.launch.server import (SGLangServer, hicache_args, radixtier_args, start_together,
                                                  stop_servers_on_sigterm)
from radixtier.native_dtype import resolve_dtype

HOST_PHASE = "after other traffic"  # back after other requests pushed the history out of the device tier
L3_PHASES = ("after flush", "after restart")  # back after the history left device and host
RETURNING = (HOST_PHASE,) + L3_PHASES
PHASES = ("first visit",) + RETURNING
SETTLE_S = 2.0  # after the history: SGLang's backup thread writes the last requests' pages
PATHS = ("recompute", "radixtier")
# Greedy answers must match recompute's token for token, each logprob within this bound. Measured between
# a cached and a recomputed prefix of the wide-MLP model: up to 0.008 in bf16; fp32 rounds far less.
LOGPROB_TOL = {"bfloat16": 0.02, "float32": 0.002, "auto": 0.02}


def add_server_demo_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about a minute and a half on two "
                                                           "cores; the default run about three minutes)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where SGLang runs the model (auto: cuda when present); cpu uses radixtier's CPU support layer")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="what the toy model computes in on the CPU (auto: bfloat16 where the CPU has AVX-512 BF16 "
                         "or AMX, else float32, which such a CPU runs about 4x faster)")
    ap.add_argument("--concurrency", type=int, default=2, help="clients sending requests at once (default 2)")
    ap.add_argument("--hicache-ratio", type=float, default=None,
                    help="SGLang's host tier size as a multiple of the device tier (default: enough for every "
                         "conversation's history, so the users back after other traffic find it in host)")
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
        return http_load.multi_turn_chat(2, 2, 1000, 150, 80, seed) if quick else \
            http_load.multi_turn_chat(3, 3, 2000, 250, 120, seed)

    def agents(seed):
        return http_load.agent_fleet(1, 2, 2, 1200, 120, 150, seed) if quick else \
            http_load.agent_fleet(2, 2, 2, 2500, 150, 250, seed)

    return {"multi-turn chat": {p: chat(101 + i) for i, p in enumerate(RETURNING)},
            "agent fleet": {p: agents(201 + i) for i, p in enumerate(RETURNING)}}


def tier_sizes(plan: Mapping[Tuple[str, str, int], List[http_load.Conversation]], concurrency: int) -> Tuple[int, float]:
    """(device tokens, host ratio) for a plan: the device holds the longest prompts of `concurrency` + 1
    requests (64-token pages), so the histories that follow the host phase's push it out of the
    device; the host holds every history (an upper bound: shared system prompts counted per
    conversation), so it is all still there when those users come back."""
    prompts = [http_load.prompt_tokens(t) for convs in plan.values() for c in convs for t in c.turns]
    device = 64 * ((concurrency + 1) * max(prompts) // 64 + 1)
    history = sum(http_load.prompt_tokens(c.turns[-2]) for convs in plan.values() for c in convs if len(c.turns) > 1)
    return device, max(2.0, math.ceil(10 * 1.2 * history / device) / 10)


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


Plan = Mapping[Tuple[str, str, int], List[http_load.Conversation]]


def serve_history(s: SGLangServer, plan: Plan, *, concurrency: int,
                  on_step: Callable[[str], None] = lambda _what: None) -> Dict[Tuple, http_load.Run]:
    """Every cell's history (its conversations without their last turn), the host phase's cells
    first: the histories after them push them out of the device tier, not out of the host tier.
    plan: (workload, phase in RETURNING, concurrency) -> the cell's own conversations, which share
    no prefix with another cell's. Returns the history run per cell."""
    history = {}
    for key in sorted(plan, key=lambda k: RETURNING.index(k[1])):
        on_step(f"{key[0]}, history")
        history[key] = http_load.replay(s.url, http_load.split_last_turn(plan[key])[0], concurrency=concurrency)
    return history


def serve_returning(s: SGLangServer, plan: Plan, phases: Sequence[str],
                    on_step: Callable[[str], None] = lambda _what: None) -> Dict[Tuple, http_load.Run]:
    """Each cell of `phases`: its conversations' last turn, sent right away (HOST_PHASE), or after a
    /flush_cache that empties device and host ("after flush"); for "after restart" the caller has
    restarted the server. Returns the returning run per cell."""
    returning = {}
    for phase in phases:
        for key, convs in plan.items():
            if key[1] != phase:
                continue
            if phase == "after flush":
                s.flush_cache()
            on_step(f"{key[0]}, {phase}")
            returning[key] = http_load.replay(s.url, http_load.split_last_turn(convs)[1], concurrency=key[2])
    return returning


def returning_users(s: SGLangServer, plan: Plan, *, history_concurrency: int,
                    on_step: Callable[[str], None] = lambda _what: None
                    ) -> Tuple[Dict[Tuple, http_load.Run], Dict[Tuple, http_load.Run]]:
    """One server through every phase of `plan`: the histories, then each returning phase, restarting
    the server before "after restart". Returns (history run, returning run) per cell.
    bench/sglang_server.py measures through this."""
    history = serve_history(s, plan, concurrency=history_concurrency, on_step=on_step)
    time.sleep(SETTLE_S)  # the last requests' backups land before the tiers are emptied
    phases = [p for p in RETURNING if any(k[1] == p for k in plan)]
    returning = serve_returning(s, plan, [p for p in phases if p != "after restart"], on_step)
    if "after restart" in phases:
        on_step("restarting SGLang")
        s.restart()
        returning.update(serve_returning(s, plan, ["after restart"], on_step))
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
    if a.hicache_ratio is not None and not a.hicache_ratio > 1:
        raise ValueError(f"--hicache-ratio: SGLang needs a host tier larger than the device's, got {a.hicache_ratio}")
    dtype, why = resolve_dtype(a.dtype) if device == "cpu" else ("auto", "SGLang's choice on CUDA")
    tmp = tempfile.mkdtemp(prefix="radixtier-demo-")
    try:
        path = a.namespace or os.path.join(tmp, "namespace.img")
        _prepare_namespace(path, a.force)
        logs = a.logs or os.path.join(tmp, "logs")
        spec = WIDE_MLP
        loads = _workloads(a.quick)
        plan = {(w, phase, a.concurrency): convs for w, phases in loads.items() for phase, convs in phases.items()}
        device_tokens, auto_ratio = tier_sizes(plan, a.concurrency)
        ratio = a.hicache_ratio or auto_ratio
        where = "CPU, radixtier's CPU support layer" if device == "cpu" else "CUDA"
        print(f"radixtier demo: SGLang's real server ({where}), toy Llama computing in {dtype} ({why}); "
              f"{spec.layers} layers, hidden {spec.hidden}, MLP {spec.intermediate}, random weights, "
              f"{spec.kv_bytes_per_token(dtype)} KV bytes/token, 64-token pages; device tier {device_tokens} tokens, "
              f"host {ratio:g}x", flush=True)
        print(f"tier 3: {path} (radixtier's embedded default: file namespace + in-process index)", flush=True)
        model = write_model(os.path.join(tmp, "toy-llama"), spec)
        common = ["--page-size", "64", "--max-total-tokens", str(device_tokens), "--enable-cache-report",
                  "--log-level", "warning"]
        servers = {
            "recompute": hicache_args(extra_config=None, backend="", ratio=ratio, device=device),
            "radixtier": radixtier_args(path, capacity=a.capacity, partitions=1, node_id="demo", ratio=ratio,
                                        device=device)}
        servers = {p: SGLangServer(model, common + args, log_path=os.path.join(logs, f"{p}.log"), device=device,
                                   dtype=dtype) for p, args in servers.items()}
        order = ("radixtier", "recompute")  # the other waits paused (an idle scheduler spins a core)
        steps = 2 + len(PATHS) * (2 + len(plan) + len(plan))
        bar = tqdm(total=steps, desc="demo", unit="step", file=sys.stderr)
        history: Dict[str, Dict[Tuple, http_load.Run]] = {}
        returning: Dict[str, Dict[Tuple, http_load.Run]] = {p: {} for p in PATHS}

        def step(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        # --quick restarts only the radixtier server: with no L3 a restart leaves the recompute server the
        # same empty tiers as /flush_cache, and its fresh process is slower still (measured: its TTFT after
        # a restart 1.3x its TTFT after a flush), so the comparison only gets harder for radixtier
        restarted = PATHS if not a.quick else ("radixtier",)
        try:
            step("starting both servers")
            start_together(list(servers.values()))
            for s in servers.values():
                s.pause()
            for pname in order:  # history, host phase, flush phase; the other server paused meanwhile
                s = servers[pname]
                s.resume()
                s.warm_up()
                on_step = lambda what, pname=pname: step(f"{pname}: {what}")  # noqa: E731
                history[pname] = serve_history(s, plan, concurrency=a.concurrency, on_step=on_step)
                if pname == "radixtier":
                    time.sleep(SETTLE_S)  # the last requests' backups land before the tiers are emptied
                returning[pname].update(serve_returning(s, plan, (HOST_PHASE, "after flush"), on_step))
                s.pause()
            step("restarting " + " and ".join(restarted))
            for pname in restarted:
                servers[pname].stop()
            start_together([servers[p] for p in restarted])
            for pname in restarted:
                servers[pname].pause()
            for pname in order:
                s = servers[pname]
                s.resume()
                if pname in restarted:
                    s.warm_up()
                else:
                    s.flush_cache()
                on_step = lambda what, pname=pname: step(f"{pname}: {what}")  # noqa: E731
                returning[pname].update(serve_returning(s, plan, ("after restart",), on_step))
                s.stop()
        finally:
            for s in servers.values():
                s.stop()
            bar.close()
        results: Dict[str, Dict[str, Dict[str, http_load.Run]]] = {w: {p: {} for p in PHASES} for w in loads}
        for pname in PATHS:
            for (w, phase, _c), run in returning[pname].items():
                results[w][phase][pname] = run
            for w in loads:
                firsts = [run for (hw, _p, _c), run in history[pname].items() if hw == w]
                results[w]["first visit"][pname] = http_load.Run([r for run in firsts for r in run.replies],
                                                                sum(run.wall_s for run in firsts))
        startup = {p: s.startup_s for p, s in servers.items()}
        report = _report(results, startup, device, dtype, device_tokens, ratio, a)
        if a.quick:
            print("(--quick restarts only the radixtier server: the recompute server's 'after restart' users are "
                  "served after /flush_cache, which leaves it the same empty tiers in a warm process)")
        report["restarted"] = list(restarted)
        if a.png:
            _plot(results, a.png, dtype)
            print(f"plot written to {a.png}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=2)
            print(f"figures written to {a.json}")
        return 0 if report["all_identical"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the model, a temporary namespace, logs unless --logs


def _report(results, startup, device, dtype, device_tokens, ratio, a) -> Dict[str, object]:
    print()
    print(f"{'workload':16s} {'phase':19s} {'path':10s} {'reqs':>4s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'req/s':>6s}   "
          f"prompt tokens served from: {'device':>7s} {'host':>7s} {'tier 3':>7s} {'computed':>8s}")
    out: Dict[str, object] = {"device": device, "dtype": dtype, "device_tokens": device_tokens, "hicache_ratio": ratio,
                              "concurrency": a.concurrency, "quick": a.quick, "server_startup_s": startup,
                              "workloads": {}}
    all_same = True
    worst = 0.0
    lines = []
    for wname, phases in results.items():
        for phase, paths in phases.items():
            for pname in PATHS:
                s = paths[pname].summary()
                computed = 1 - s["device_share"] - s["host_share"] - s["storage_share"]
                print(f"{wname:16s} {phase:19s} {pname:10s} {s['requests']:4d} {s['ttft_p50_s'] * 1e3:7.0f}ms "
                      f"{s['ttft_p99_s'] * 1e3:7.0f}ms {s['throughput_rps']:6.2f}   {'':26s}"
                      f"{100 * s['device_share']:6.1f}% {100 * s['host_share']:6.1f}% {100 * s['storage_share']:6.1f}% "
                      f"{100 * computed:7.1f}%")
                out["workloads"].setdefault(wname, {}).setdefault(phase, {})[pname] = s
            rec, rt = paths["recompute"], paths["radixtier"]
            agree = http_load.agreement(rec, rt, logprob_tol=LOGPROB_TOL[dtype], near_tie=LOGPROB_TOL[dtype])
            all_same &= not agree["differ"]
            worst = max(worst, agree["worst_logprob_diff"][0])
            srec, srt = rec.summary(), rt.summary()
            speed = {"ttft_p50_speedup": srec["ttft_p50_s"] / srt["ttft_p50_s"],
                     "ttft_p99_speedup": srec["ttft_p99_s"] / srt["ttft_p99_s"],
                     "throughput_gain": srt["throughput_rps"] / srec["throughput_rps"],
                     "answers_identical": f"{len(agree['identical'])}/{len(rt.replies)}",
                     "answers_parted_at_a_tie": agree["ties"], "answers_differ": agree["differ"]}
            out["workloads"][wname][phase]["radixtier_vs_recompute"] = speed
            ties = f" ({len(agree['ties'])} parted at a near-tie)" if agree["ties"] else ""
            if phase == HOST_PHASE:
                lines.append(f"{wname}, {phase}: {100 * srt['host_share']:.0f}% of prompt tokens from the host tier "
                             f"(SGLang's L2, the same on both servers: TTFT p50 {srt['ttft_p50_s'] * 1e3:.0f} and "
                             f"{srec['ttft_p50_s'] * 1e3:.0f} ms); greedy answers identical "
                             f"{speed['answers_identical']}{ties}")
            elif phase in L3_PHASES:
                lines.append(f"{wname}, {phase}: radixtier TTFT p50 {speed['ttft_p50_speedup']:.1f}x faster, p99 "
                             f"{speed['ttft_p99_speedup']:.1f}x, throughput {speed['throughput_gain']:.2f}x vs recompute; "
                             f"{100 * srt['storage_share']:.0f}% of prompt tokens from tier 3; greedy answers "
                             f"identical {speed['answers_identical']}{ties}")
    print("(TTFT: first streamed token as the client sees it; the shares are SGLang's own cached_tokens_details)")
    print()
    for line in lines:
        print(line)
    out["all_identical"], out["worst_logprob_diff"], out["logprob_tol"] = all_same, worst, LOGPROB_TOL[dtype]
    print(f"(identical: every greedy token equal and its logprob within {LOGPROB_TOL[dtype]} of recompute's; the "
          f"largest difference seen: {worst:.2g})")
    if not all_same:
        print("radixtier demo: some answers differ from recompute (see --json)", file=sys.stderr)
    return out


def _plot(results, png: str, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(w, p) for w, phases in results.items() for p in phases]
    labels = [f"{w}\n{p}" for w, p in cells]
    xs = range(len(cells))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    for i, pname in enumerate(PATHS):
        ax1.bar([x + (i - 0.5) * 0.4 for x in xs],
                [results[w][p][pname].summary()["ttft_p50_s"] * 1e3 for w, p in cells], 0.4, label=pname)
    ax1.set_xticks(list(xs), labels, fontsize=7, rotation=20, ha="right")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title(f"TTFT through SGLang's real server (toy model in {dtype})")
    ax1.legend()
    bottom = [0.0] * len(cells)
    for tier, label in (("device", "device (L1)"), ("host", "host (L2)"), ("storage", "tier 3 (radixtier)")):
        vals = [100 * results[w][p]["radixtier"].summary()[f"{tier}_share"] for w, p in cells]
        ax2.bar(list(xs), vals, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.bar(list(xs), [100 - b for b in bottom], 0.6, bottom=bottom, label="computed", color="lightgrey")
    ax2.set_xticks(list(xs), labels, fontsize=7, rotation=20, ha="right")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("% of prompt tokens (SGLang's cached_tokens_details)")
    ax2.set_title("radixtier server: where prompt tokens came from")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
