"""The planner (radixtier/costmodel.py) applied to the demo's own run: its measured prefill rate and
tier-3 bandwidth, its concurrency, and each request's reuse, against the TTFT the demo measured.
This is how `radixtier plan` is checked: same model, inputs measured here, error stated."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Dict, List

from radixtier.demo.serving import RequestResult
from radixtier.demo.toymodel import ToyLlama
from radixtier.costmodel import Inputs, request_ttft


@dataclass
class MeasuredHardware:
    prefill_tps: float
    prefill_overhead_s: float
    prefix_cost_s_per_token: float
    tier_gbps: float


def _median_time(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def measure_prefill(model: ToyLlama, sizes=(128, 1024), reps: int = 5) -> tuple:
    """(tokens/s, fixed seconds, seconds per reused prefix token) of the model's prefill: a line
    through two prompt sizes (short ones, like the suffixes a cache leaves to compute), and a short
    suffix run with and without a prefix of the larger size."""
    times = [_median_time(lambda n=n: model.prefill(list(range(1, n + 1))), reps) for n in sizes]
    per_token = max(1e-9, (times[1] - times[0]) / (sizes[1] - sizes[0]))
    prompt = list(range(1, sizes[1] + 129))  # a 128-token suffix, about what the demo's turns add
    _first, pages = model.prefill(prompt[:sizes[1]])
    prefix = pages[: sizes[1] // model.page_size]
    with_prefix = _median_time(lambda: model.prefill(prompt, prefix), reps)
    alone = _median_time(lambda: model.prefill(prompt[sizes[1]:]), reps)
    return 1.0 / per_token, max(0.0, times[0] - sizes[0] * per_token), max(0.0, (with_prefix - alone) / sizes[1])


def predicted_mean_ttft(results: List[RequestResult], hw: MeasuredHardware, kv_bytes_per_token: int,
                        concurrency: int) -> float:
    """Mean TTFT the planner predicts for these requests: per request, compute its new tokens and load
    what tier 3 served; requests queue `concurrency` deep (plan.request_ttft, averaged)."""
    inp = Inputs(1, 0.0, concurrency, hw.prefill_tps, hw.prefill_overhead_s, hw.prefix_cost_s_per_token,
                 tier_gbps=hw.tier_gbps)
    steps, fills = [], []
    for r in results:
        load = (r.hits.get("storage", 0) + r.hits.get("remote", 0)) * kv_bytes_per_token / (hw.tier_gbps * 1e9)
        c = request_ttft(r.prompt_tokens - r.reused_tokens, load, inp, r.reused_tokens)
        steps.append(max(c["compute_s"], c["load_s"]))
        fills.append(c["compute_s"] + c["load_s"])
    return (concurrency - 1) * statistics.fmean(steps) + statistics.fmean(fills)


def reuse_by_tier(summary: Dict[str, object]) -> Dict[str, float]:
    """Share of the prompt tokens each tier served (device, host, tier 3), 0..1."""
    hits = summary["hit_tokens_by_tier"]
    prompt = summary["prompt_tokens"]
    return {t: hits.get(t, 0) / prompt if prompt else 0.0 for t in ("device", "host", "storage")}
