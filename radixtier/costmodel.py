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
Inputs are checked against the Ranges below (zero, negative, NaN, inf and absurdly large values are
one-line errors naming the option or field and the value).
What it leaves out: decode steps interleaved with prefill, KV transfer host -> GPU (PCIe is
faster than any of the storage paths above), attention's quadratic term at very long contexts.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

PATHS = ("recompute", "local_nvme", "tiered_nvmeof")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class Range:
    """What one numeric input may be. The bounds are wide (far past any real model or machine) but
    finite on purpose: with every input inside them, even at the corners, each TTFT, throughput
    and ratio the model computes is a finite float > 0, so no input can produce a traceback
    (int-to-float overflow, division by zero) or a verdict built on inf or NaN. (The break-even
    bandwidth alone is inf by design, where reusing a token costs more than computing it.)"""

    low: float
    high: float
    whole: bool = False

    def describe(self) -> str:
        if self.whole:
            return f"a whole number from {self.low} to {self.high}"
        return f"a number from {self.low:g} to {self.high:g}"


COUNT = Range(1, 2**31 - 1, whole=True)  # layers, heads, dimensions, tokens, requests
ELEMENT_BYTES = Range(1, 8, whole=True)  # fp8 .. fp64
SHARE = Range(0.0, 1.0)
RATE = Range(1e-6, 1e9)  # tokens/s or GB/s
SECONDS = Range(0.0, 1e6)
SECONDS_PER_TOKEN = Range(0.0, 1e3)
MICROSECONDS = Range(0.0, 1e9)

# `radixtier plan`'s numeric options: option -> (argparse attribute, range)
GEOMETRY_OPTIONS: Dict[str, Tuple[str, Range]] = {
    "--layers": ("layers", COUNT), "--kv-heads": ("kv_heads", COUNT), "--head-dim": ("head_dim", COUNT),
    "--mla-dim": ("mla_dim", COUNT), "--dtype-bytes": ("dtype_bytes", ELEMENT_BYTES)}
INPUT_OPTIONS: Dict[str, Tuple[str, Range]] = {
    "--context": ("context", COUNT), "--hit-rate": ("hit_rate", SHARE), "--concurrency": ("concurrency", COUNT),
    "--prefill-tps": ("prefill_tps", RATE), "--prefill-overhead-s": ("prefill_overhead_s", SECONDS),
    "--prefix-cost-us-per-token": ("prefix_cost_us_per_token", MICROSECONDS), "--local-gbps": ("local_gbps", RATE),
    "--tier-gbps": ("tier_gbps", RATE), "--net-gbps": ("net_gbps", RATE)}


def _shown(value: Any, show: Callable[[Any], str] = repr) -> str:
    """`value` as an error message shows it: a 400-digit number is abbreviated, not echoed whole."""
    text = show(value)
    length = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= 40 else f"{text[:24]}... ({length} characters)"


def check_value(name: str, value: Any, rng: Range, show: Callable[[Any], str] = repr,
                text: bool = True) -> Union[int, float]:
    """`value` (a number, or with `text` the text of one as typed on the command line) inside `rng`,
    or a one-line ValueError naming `name` and the value. A bool, a fraction where a whole number
    belongs, inf and NaN are refused; a whole number's text is parsed as an int, never via float."""
    number: Any = value
    if text and isinstance(value, str):
        try:
            number = int(value.strip()) if rng.whole else float(value)
        except ValueError:
            number = None
    ok = (not isinstance(number, bool) and isinstance(number, int if rng.whole else (int, float))
          and rng.low <= number <= rng.high)
    if not ok:
        raise ValueError(f"{name}: expected {rng.describe()}, got {_shown(value, show)}")
    return number if rng.whole else float(number)


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
        """From a Hugging Face config.json (Llama/Qwen/Mistral-style GQA, or DeepSeek-style MLA); a
        field with an impossible value is a one-line error naming the file, the field and the value."""
        c = _read_config(path)
        try:
            return _geometry_from_config(c, f"config: {path}")
        except KeyError as exc:
            raise ValueError(f"config: {path} lacks a field the KV size needs ({exc}); give --layers, "
                             f"--kv-heads and --head-dim instead") from None


def _read_config(path: str) -> Dict[str, Any]:
    """The config's JSON object (a multimodal config's `text_config`, the language model's), or a
    one-line ValueError: an unreadable file, text that is not JSON, or JSON that is not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except OSError as exc:
        raise ValueError(f"config: cannot read {path} ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"config: {path} is not a JSON file ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(c, dict):
        raise ValueError(f"config: {path}: expected a JSON object, got {type(c).__name__}")
    if "text_config" in c:
        c = c["text_config"]
        if not isinstance(c, dict):
            raise ValueError(f"config: {path}: text_config: expected a JSON object, got {_shown(c, json.dumps)}")
    return c


def _config_count(c: Dict[str, Any], field: str, where: str) -> int:
    """A whole-number field of a config (KeyError if absent), its value shown as JSON spells it."""
    return int(check_value(f"{where}: {field}", c[field], COUNT, show=json.dumps, text=False))


def _geometry_from_config(c: Dict[str, Any], where: str) -> KVGeometry:
    """The KV geometry a config describes; absent optional fields (null or missing) take HF's defaults."""
    layers = _config_count(c, "num_hidden_layers", where)
    dtype = DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2)
    if c.get("kv_lora_rank"):  # absent, null or 0: not an MLA model
        rope = 64 if c.get("qk_rope_head_dim") is None else _config_count(c, "qk_rope_head_dim", where)
        return KVGeometry(layers, dtype_bytes=dtype, mla_dim=_config_count(c, "kv_lora_rank", where) + rope)
    heads = _config_count(c, "num_attention_heads", where)
    kv_heads = heads if c.get("num_key_value_heads") is None else _config_count(c, "num_key_value_heads", where)
    if c.get("head_dim") is not None:
        return KVGeometry(layers, kv_heads, _config_count(c, "head_dim", where), dtype)
    hidden = _config_count(c, "hidden_size", where)
    if hidden < heads:
        raise ValueError(f"{where}: hidden_size: expected at least num_attention_heads ({heads}) so each head "
                         f"has a dimension, got {hidden}")
    return KVGeometry(layers, kv_heads, hidden // heads, dtype)


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
        """Every field inside its Range (one-line ValueError naming the field and the value)."""
        for name, rng in _INPUT_RANGES.items():
            check_value(name, getattr(self, name), rng)


_INPUT_RANGES: Dict[str, Range] = {
    "context_tokens": COUNT, "hit_rate": SHARE, "concurrency": COUNT, "prefill_tps": RATE,
    "prefill_overhead_s": SECONDS, "prefix_cost_s_per_token": SECONDS_PER_TOKEN, "local_gbps": RATE,
    "tier_gbps": RATE, "net_gbps": RATE}


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
    """TTFT of each path against context length, the other inputs fixed, written to `png`: drawn in
    memory first, then written by write_file, so a plot that cannot be written is an error naming
    --png rather than "plot written" (matplotlib's savefig did not report /dev/full)."""
    write_file("--png", png, render_plot(geom, inp))


def render_plot(geom: KVGeometry, inp: Inputs) -> bytes:
    """The plot as PNG bytes."""
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def check_output_path(option: str, path: str) -> None:
    """Refuse an output path whose folder does not exist (or that is a folder) before anything slow
    (--measure takes a while) runs; the write itself is checked by write_file."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option}: cannot write {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{option}: cannot write {path}: it is a folder")


def write_file(option: str, path: str, data: bytes) -> None:
    """Write all of `data` to `path` and close it, or raise a one-line ValueError naming `option` and
    `path`: a write that fails or comes up short (a full disk, /dev/full, a file-size limit) is never
    reported as written, and a regular file left holding part of it is removed (a device is not)."""
    import stat

    try:
        with open(path, "wb", buffering=0) as f:
            view = memoryview(data)
            while view:
                n = f.write(view)
                if not n:
                    raise OSError(f"the write stopped after {len(data) - len(view)} of {len(data)} bytes")
                view = view[n:]
    except OSError as exc:
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass
        raise ValueError(f"{option}: cannot write {path} ({exc.strerror or exc})") from None


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


def _checked_options(a, options: Dict[str, Tuple[str, Range]]) -> Dict[str, Union[int, float, None]]:
    """attribute -> the option's value checked against its Range (None where not given): the command
    line's text goes straight to check_value, so its error names the option as typed (--context)."""
    out: Dict[str, Union[int, float, None]] = {}
    for option, (attr, rng) in options.items():
        value = getattr(a, attr)
        out[attr] = None if value is None else check_value(option, value, rng)
    return out


def geometry_from_args(a) -> KVGeometry:
    """The geometry from --config, or from the numbers; every number given is checked either way."""
    g = _checked_options(a, GEOMETRY_OPTIONS)
    if a.config:
        return KVGeometry.from_hf_config(a.config)
    if not g["layers"] or not ((g["kv_heads"] and g["head_dim"]) or g["mla_dim"]):
        raise ValueError("config: give --config config.json, or --layers with --kv-heads and --head-dim "
                         "(or --mla-dim for MLA)")
    return KVGeometry(int(g["layers"]), int(g["kv_heads"] or 0), int(g["head_dim"] or 0), int(g["dtype_bytes"]),
                      int(g["mla_dim"] or 0))


def inputs_from_args(a, tier_gbps: Optional[float] = None) -> Inputs:
    """The workload and hardware inputs, each option checked (one line naming it and its value)."""
    v = _checked_options(a, INPUT_OPTIONS)
    inp = Inputs(int(v["context"]), v["hit_rate"], int(v["concurrency"]), v["prefill_tps"], v["prefill_overhead_s"],
                 v["prefix_cost_us_per_token"] * 1e-6, v["local_gbps"],
                 tier_gbps if tier_gbps is not None else v["tier_gbps"], v["net_gbps"])
    inp.check()
    return inp
