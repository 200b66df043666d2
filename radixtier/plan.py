"""`radixtier plan`: a cost model of TTFT and throughput for the three paths the field compares --
recompute the prefix, reload it from local NVMe, reload it from tiered NVMe-oF -- from a model's
KV geometry, the GPUs' prefill rate, storage and network bandwidth, context, hit rate and
concurrency. Small and stated, so a buyer can check a tiering claim for their own model.

The model (every assumption is a line below):
- KV bytes per token: 2 x layers x kv_heads x head_dim x dtype bytes (MHA/GQA), or
  layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes (MLA).
- One request's prefill of n new tokens takes n / prefill_tps + prefill_overhead_s on the
  GPUs, one request at a time (a prefill batch of 1, as chunked prefill of long prompts is),
  plus prefix_cost_s_per_token for each reused token (bringing its KV into the attention and
  attending over it; small on GPUs, measured by the demo on the CPU).
- Reloading c cached tokens takes c x kv_bytes / bandwidth; the path's bandwidth is local NVMe,
  or min(NVMe-oF target, network) for tiered storage. Reloads pipeline with other requests'
  prefill (prefetch), so a stream of requests runs at 1 / max(compute, load) per second.
- `concurrency` requests are in flight at once (closed loop): a request waits for the ones
  ahead, so TTFT = (concurrency - 1) x max(compute, load) + compute + load (the pipeline fill).
- Recompute computes the whole context; the other paths compute only the uncached suffix.
What it leaves out: decode steps interleaved with prefill, KV transfer host -> GPU (PCIe is
faster than any of the storage paths above), attention's quadratic term at very long contexts.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, Optional

PATHS = ("recompute", "local_nvme", "tiered_nvmeof")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}


@dataclass
class KVGeometry:
    """A model's KV cache shape: what one token costs to keep (and to move)."""

    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    mla_dim: int = 0  # kv_lora_rank + qk_rope_head_dim for MLA models; 0 for MHA/GQA

    @property
    def attention(self) -> str:
        return "MLA" if self.mla_dim else ("MHA/GQA" if self.kv_heads else "?")

    def bytes_per_token(self) -> int:
        if self.mla_dim:
            return self.layers * self.mla_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @staticmethod
    def from_hf_config(path: str) -> "KVGeometry":
        """From a Hugging Face config.json (Llama/Qwen/Mistral-style GQA, or DeepSeek-style MLA)."""
        with open(path) as f:
            c = json.load(f)
        c = c.get("text_config", c)  # multimodal configs nest the language model's
        try:
            layers = int(c["num_hidden_layers"])
            dtype = DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2)
            if c.get("kv_lora_rank"):
                return KVGeometry(layers, dtype_bytes=dtype,
                                  mla_dim=int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 64)))
            heads = int(c["num_attention_heads"])
            kv_heads = int(c.get("num_key_value_heads") or heads)
            head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config: {path} lacks a field the KV size needs ({exc}); give --layers, "
                             f"--kv-heads and --head-dim instead") from None
        return KVGeometry(layers, kv_heads, head_dim, dtype)


@dataclass
class Inputs:
    context_tokens: int
    hit_rate: float  # share of the context that is a cached prefix
    concurrency: int
    prefill_tps: float  # tokens per second the GPUs prefill
    prefill_overhead_s: float = 0.0  # fixed cost of one prefill (launch, sampling)
    prefix_cost_s_per_token: float = 0.0  # cost per reused prefix token in the prefill that reuses it
    local_gbps: float = 3.0  # local NVMe read GB/s
    tier_gbps: float = 5.0  # NVMe-oF target read GB/s
    net_gbps: float = 12.5  # network GB/s (100 Gb/s)

    def check(self) -> None:
        for name in ("context_tokens", "concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name.replace('_', '-')}: expected a whole number >= 1, got {v!r}")
        if not 0.0 <= self.hit_rate <= 1.0:
            raise ValueError(f"hit-rate: expected 0..1, got {self.hit_rate!r}")
        for name in ("prefill_tps", "local_gbps", "tier_gbps", "net_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name.replace('_', '-')}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("prefill_overhead_s", "prefix_cost_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')}: expected >= 0, got {getattr(self, name)!r}")


def request_ttft(new_tokens: float, load_s: float, inp: Inputs, cached_tokens: float = 0.0) -> Dict[str, float]:
    """One path's per-request costs and the resulting TTFT and throughput (see module docstring)."""
    compute = new_tokens / inp.prefill_tps + inp.prefill_overhead_s + cached_tokens * inp.prefix_cost_s_per_token
    step = max(compute, load_s)
    return {"compute_s": compute, "load_s": load_s, "ttft_s": (inp.concurrency - 1) * step + compute + load_s,
            "throughput_rps": 1.0 / step if step > 0 else float("inf")}


def predict(geom: KVGeometry, inp: Inputs) -> Dict[str, object]:
    inp.check()
    kvb = geom.bytes_per_token()
    cached = inp.hit_rate * inp.context_tokens
    new = inp.context_tokens - cached
    bw = {"local_nvme": inp.local_gbps, "tiered_nvmeof": min(inp.tier_gbps, inp.net_gbps)}
    out: Dict[str, Dict[str, object]] = {"recompute": request_ttft(inp.context_tokens, 0.0, inp)}
    out["recompute"]["bottleneck"] = "prefill compute"
    for path, gbps in bw.items():
        r = request_ttft(new, cached * kvb / (gbps * 1e9), inp, cached)
        limit = "prefill compute" if r["compute_s"] >= r["load_s"] else (
            "network" if path == "tiered_nvmeof" and inp.net_gbps < inp.tier_gbps else "storage bandwidth")
        r["bottleneck"] = limit
        out[path] = r
    # GB/s at which reloading a token costs what computing it does (net of what reusing it costs)
    net = 1.0 / inp.prefill_tps - inp.prefix_cost_s_per_token
    breakeven = kvb / net / 1e9 if net > 0 else float("inf")
    rec, tier, local = out["recompute"], out["tiered_nvmeof"], out["local_nvme"]
    return {"kv_bytes_per_token": kvb, "attention": geom.attention, "inputs": asdict(inp), "paths": out,
            "breakeven_gbps": breakeven,
            "tiering_pays_off": tier["ttft_s"] < rec["ttft_s"],
            "tiered_vs_recompute_ttft": rec["ttft_s"] / tier["ttft_s"],
            "tiered_vs_local_ttft": local["ttft_s"] / tier["ttft_s"],
            "tiered_vs_local_throughput": tier["throughput_rps"] / local["throughput_rps"]}


def verdict(p: Dict[str, object]) -> str:
    """The field's rules of thumb applied to one prediction, in a sentence."""
    inp = p["inputs"]
    bw = min(inp["tier_gbps"], inp["net_gbps"])
    if bw < p["breakeven_gbps"]:
        why = (f"reloading a token ({p['kv_bytes_per_token']} B at {bw:.1f} GB/s) is slower than computing it "
               f"(break-even {p['breakeven_gbps']:.2f} GB/s): recompute, or cache only in memory")
    elif inp["hit_rate"] * inp["context_tokens"] < 2048:
        why = "the cached prefix is short: its reload saves little next to the fixed costs"
    else:
        why = (f"reload beats recompute {p['tiered_vs_recompute_ttft']:.1f}x on TTFT; the cached share of the "
               f"context ({inp['hit_rate']:.0%}) and concurrency {inp['concurrency']} decide how much")
    return ("tiering pays off: " if p["tiering_pays_off"] else "tiering does not pay off: ") + why


def measure_read_gbps(path: str, total_bytes: int = 256 << 20, page_bytes: int = 1 << 20,
                      progress=None) -> float:
    """Tier-3 read GB/s with the store's own verified reads, on a temporary namespace in `path` (a
    directory, or a file path to create): written once, dropped from the page cache, read back."""
    import tempfile
    import time

    from radixtier.storage.nvmeof.io_engine import aligned_buffer
    from radixtier.storage.nvmeof.store import NvmeofPageStore

    folder = path if os.path.isdir(path) else (os.path.dirname(os.path.abspath(path)) or ".")
    work = tempfile.mkdtemp(prefix="radixtier-plan-", dir=folder)
    ns = os.path.join(work, "measure.img")
    n = max(8, total_bytes // page_bytes)
    try:
        store = NvmeofPageStore(ns, page_bytes, create_bytes=(n + 64) * (page_bytes + 8192), node_id="plan",
                                sync=False)
        try:
            keys = [i.to_bytes(16, "little") for i in range(1, n + 1)]
            src = aligned_buffer(page_bytes)
            src[:] = os.urandom(page_bytes)
            batch = 64
            for i in range(0, n, batch):
                assert all(store.put(keys[i:i + batch], [src] * len(keys[i:i + batch])).ok)
                if progress:
                    progress(len(keys[i:i + batch]))
            os.sync()
            fd = os.open(ns, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            dst = aligned_buffer(batch * page_bytes)
            bufs = [dst[j * page_bytes:(j + 1) * page_bytes] for j in range(batch)]
            t = time.perf_counter()
            for i in range(0, n, batch):
                assert all(store.get(keys[i:i + batch], bufs[:len(keys[i:i + batch])]))
                if progress:
                    progress(len(keys[i:i + batch]))
            return n * page_bytes / (time.perf_counter() - t) / 1e9
        finally:
            store.close()
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def plot(geom: KVGeometry, inp: Inputs, png: str) -> None:
    """TTFT of each path against context length, the other inputs fixed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dataclasses import replace

    contexts = [1 << k for k in range(10, 19)]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for path, style in zip(PATHS, ("o-", "s--", "^-")):
        ys = [predict(geom, replace(inp, context_tokens=c))["paths"][path]["ttft_s"] for c in contexts]
        ax.plot(contexts, ys, style, label=path.replace("_", " "))
    ax.axvline(inp.context_tokens, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("predicted TTFT (s)")
    ax.set_title(f"{geom.attention}, {geom.bytes_per_token() // 1024} KiB KV/token, hit {inp.hit_rate:.0%}, "
                 f"concurrency {inp.concurrency}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def format_report(p: Dict[str, object]) -> str:
    inp = p["inputs"]
    lines = [f"KV: {p['attention']}, {p['kv_bytes_per_token']} bytes/token; context {inp['context_tokens']} tokens, "
             f"hit rate {inp['hit_rate']:.0%}, concurrency {inp['concurrency']}, prefill {inp['prefill_tps']:.0f} tok/s",
             f"bandwidth: local NVMe {inp['local_gbps']:.2f} GB/s, NVMe-oF {inp['tier_gbps']:.2f} GB/s over a "
             f"{inp['net_gbps']:.2f} GB/s network; break-even {p['breakeven_gbps']:.2f} GB/s", "",
             f"  {'path':14s} {'TTFT':>10s} {'compute':>10s} {'load':>10s} {'req/s':>8s}  bottleneck"]
    for path in PATHS:
        r = p["paths"][path]
        lines.append(f"  {path:14s} {r['ttft_s'] * 1e3:8.0f}ms {r['compute_s'] * 1e3:8.0f}ms {r['load_s'] * 1e3:8.0f}ms "
                     f"{r['throughput_rps']:8.2f}  {r['bottleneck']}")
    lines += ["", f"tiered NVMe-oF vs recompute: TTFT {p['tiered_vs_recompute_ttft']:.2f}x; vs local NVMe: TTFT "
                  f"{p['tiered_vs_local_ttft']:.2f}x, throughput {p['tiered_vs_local_throughput']:.2f}x", verdict(p)]
    return "\n".join(lines)


def geometry_from_args(a) -> KVGeometry:
    if a.config:
        return KVGeometry.from_hf_config(a.config)
    if not a.layers or not ((a.kv_heads and a.head_dim) or a.mla_dim):
        raise ValueError("config: give --config config.json, or --layers with --kv-heads and --head-dim "
                         "(or --mla-dim for MLA)")
    return KVGeometry(a.layers, a.kv_heads or 0, a.head_dim or 0, a.dtype_bytes, a.mla_dim or 0)


def inputs_from_args(a, tier_gbps: Optional[float] = None) -> Inputs:
    return Inputs(a.context, a.hit_rate, a.concurrency, a.prefill_tps, a.prefill_overhead_s,
                  a.prefix_cost_us_per_token * 1e-6, a.local_gbps,
                  tier_gbps if tier_gbps is not None else a.tier_gbps, a.net_gbps)
