"""Tree operations side by side with SGLang 0.5.23's own RadixCache, in one process, interleaved:

  match full hit / half hit / miss of 32K-token requests against 1M cached tokens (32K requests
  sharing 4K system prompts), insert of 28K new tokens after a shared 4K prefix, evict 32K tokens;
  then the same operations as the cache grows (128K -> 8M cached tokens), with the slope of each.

radixtier runs as the embedded engine does (TieredKVCache: tree walk, tier split, pool slots; one-
element pages so the numbers are the tree's cost, not memcpy). SGLang runs twice:
  sglang-sim    RadixCache.create_simulated(page_size=16) with a no-op allocator (the tree alone:
                its evict frees nothing, its insert allocates nothing)
  sglang-paged  the same RadixCache over SGLang's own PagedTokenToKVPoolAllocator, as its scheduler
                runs it: insert = allocate the new tokens' slots + insert; evict frees the slots
                (its matches run the same code as sglang-sim's: they are timed once, on sglang-sim)
radixtier's insert and evict always do their slot bookkeeping (its pool). Requests hold their
tokens as array('q'), as SGLang 0.5.23's scheduler does (--token-type list for Python lists).

    python bench/tree_ops.py [--cached-tokens 1048576] [--repeats 40] [--scale 131072,...]

Writes JSON, Markdown and a PNG (time vs cached tokens per operation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from array import array
from typing import Callable, Dict, List, Tuple

import torch
from tqdm import tqdm

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace
from radixtier.tiers import Tier

OPS = ("match_full_hit", "match_half_hit", "match_miss", "insert_28k_after_shared_4k", "evict_32k")
ENGINES = ("radixtier", "sglang-sim", "sglang-paged")


class _NoFreeAllocator:
    """What RadixCache.create_simulated needs of an allocator when it evicts."""

    device = "cpu"

    def free(self, *args, **kwargs) -> None:
        pass

    def free_segment(self, *args, **kwargs) -> None:
        pass


class Workload:
    """Requests of `rt` tokens: a shared system prompt (one of 8) and a random tail."""

    def __init__(self, rt: int, shared: int, token_type: str, systems: int = 8, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.rt, self.shared = rt, shared
        self.tok = (lambda xs: array("q", xs)) if token_type == "array" else list
        self.systems = [[self.rng.randrange(32000) for _ in range(shared)] for _ in range(systems)]

    def random(self, n: int) -> List[int]:
        return [self.rng.randrange(32000) for _ in range(n)]

    def request(self, i: int):
        return self.tok(self.systems[i % len(self.systems)] + self.random(self.rt - self.shared))


class SGLangSide:
    """One SGLang RadixCache, with a no-op allocator (sim) or SGLang's paged allocator (paged)."""

    def __init__(self, kind: str, ps: int, capacity_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.EvictParams, self.InsertParams, self.MatchPrefixParams, self.RadixKey = (
            EvictParams, InsertParams, MatchPrefixParams, RadixKey)
        self.kind, self.pos = kind, 0
        self.alloc = None
        if kind == "paged":
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

            set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=ps))
            kv = MHATokenToKVPool(capacity_tokens, page_size=ps, dtype=torch.bfloat16, head_num=1, head_dim=1,
                                  layer_num=1, device="cpu", enable_memory_saver=False, start_layer=0, end_layer=1,
                                  enable_alt_stream=False)
            self.alloc = PagedTokenToKVPoolAllocator(capacity_tokens, page_size=ps, dtype=torch.bfloat16,
                                                     device="cpu", kvcache=kv, need_sort=False)
            self.cache = RadixCache.create_simulated(mock_allocator=self.alloc, page_size=ps)
        else:
            self.cache = RadixCache.create_simulated(mock_allocator=_NoFreeAllocator(), page_size=ps)

    def match(self, tokens):
        return self.cache.match_prefix(self.MatchPrefixParams(key=self.RadixKey(tokens, None)))

    def prepare_insert(self, tokens) -> Tuple[torch.Tensor, int]:
        """What the scheduler knows before a prefill: the cached prefix's slots (matched at admission)."""
        m = self.match(tokens)
        return self.cache.path_device_indices(m.last_device_node)[:m.device_prefix_len], m.device_prefix_len

    def insert(self, tokens, prefix: Tuple[torch.Tensor, int]) -> None:
        """Slots for the new tokens (the paged allocator's alloc; consecutive ids when simulated), then insert."""
        indices, cached = prefix
        new = len(tokens) - cached
        if self.alloc is not None:
            slots = self.alloc.alloc(new)
            if slots is None:
                raise RuntimeError("sglang-paged: the allocator ran out of slots (raise its capacity)")
        else:
            slots = torch.arange(self.pos, self.pos + new, dtype=torch.int64)
            self.pos += new
        value = torch.cat([indices, slots]) if cached else slots
        done = self.cache.insert(self.InsertParams(key=self.RadixKey(tokens, None), value=value))
        if self.alloc is not None and done.prefix_len > cached:  # the scheduler frees what the tree already had
            self.alloc.free(value[cached:done.prefix_len])

    def evict(self, num_tokens: int) -> None:
        self.cache.evict(self.EvictParams(num_tokens=num_tokens))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(cached_tokens: int, a, repeats: int, progress: bool = True) -> Dict[str, Dict[str, List[float]]]:
    """Fill each engine with `cached_tokens`, then time every operation `repeats` times, interleaved."""
    ps, rt, shared = a.page_size, a.request_tokens, a.shared_prefix
    n_req = max(1, cached_tokens // rt)
    wl = Workload(rt, shared, a.token_type, systems=min(8, n_req))  # every insert finds its system prompt
    capacity = cached_tokens + (repeats + 4) * rt
    ns = KVNamespace("bench", "int32", "flat", ps)
    cfg = CacheConfig(page_size=ps, page_shape=(1,), dtype=torch.int32, device_pages=capacity // ps, host_pages=16,
                      device="cpu", write_policy="write_back")
    ours = TieredKVCache(cfg, ns)
    sides = {"sglang-sim": SGLangSide("sim", ps, capacity), "sglang-paged": SGLangSide("paged", ps, capacity)}
    cached = []
    for i in tqdm(range(n_req), desc=f"fill {cached_tokens // 1024}K tokens", file=sys.stderr, disable=not progress):
        req = wl.request(i)
        ours.insert(req, torch.zeros(rt // ps, 1, dtype=torch.int32))
        for side in sides.values():
            side.insert(req, side.prepare_insert(req))
        cached.append(req)
    times = {op: {e: [] for e in ENGINES} for op in OPS}
    matched: Dict[str, set] = {op: set() for op in OPS[:3]}  # prefix lengths each engine found, per op
    kv = torch.zeros((rt - shared) // ps, 1, dtype=torch.int32)

    def run(op: str, i: int, calls: Dict[str, Callable[[], object]]) -> None:
        engines = list(calls)
        k = i % len(engines)
        for engine in engines[k:] + engines[:k]:  # the order rotates: each sees the state the others left
            times[op][engine].append(timed(calls[engine]))

    # Matches and inserts first, evictions after: evicting between matches would let each engine's
    # own LRU choice decide whether the next "full hit" is still one (SGLang's LRU victim is the
    # request matched next), so the engines would not be doing the same work.
    # A half hit splits the request's node: its target is the request inserted just before (never
    # split yet, in every engine), so a small cache's few requests are not split again and again.
    prev = wl.request(n_req)
    ours.insert(prev, torch.zeros(rt // ps, 1, dtype=torch.int32))
    for side in sides.values():
        side.insert(prev, side.prepare_insert(prev))
    for i in tqdm(range(repeats), desc="match, insert", file=sys.stderr, disable=not progress):
        req = cached[i % len(cached)]  # a full hit changes no tree: requests may be revisited
        half = prev[:rt // 2] + wl.tok(wl.random(rt // 2))
        cold = wl.tok(wl.random(rt))
        for op, tokens in (("match_full_hit", req), ("match_half_hit", half), ("match_miss", cold)):
            # both SGLang caches run the same match code (the allocator plays no part): one is timed,
            # so SGLang's second run never finds its code and the request warm from its first
            run(op, i, {"radixtier": lambda t=tokens: ours.match(t),
                        "sglang-sim": lambda t=tokens: sides["sglang-sim"].match(t)})
            matched[op].add(ours.match(tokens, beyond_memory=False).prefix_tokens)
            matched[op].update(side.match(tokens).device_prefix_len for side in sides.values())
        fresh = wl.request(i)
        prefixes = {name: side.prepare_insert(fresh) for name, side in sides.items()}
        calls = {"radixtier": lambda: ours.insert(fresh, kv, first_page=shared // ps)}
        calls.update({name: (lambda s=side, p=prefixes[name]: s.insert(fresh, p)) for name, side in sides.items()})
        run("insert_28k_after_shared_4k", i, calls)
        prev = fresh
    for i in tqdm(range(repeats), desc="evict", file=sys.stderr, disable=not progress):
        calls = {"radixtier": lambda: ours.evict(Tier.DEVICE, rt // ps)}
        calls.update({name: (lambda s=side: s.evict(rt)) for name, side in sides.items()})
        run("evict_32k", i, calls)
    times["_matched"] = {op: sorted(v) for op, v in matched.items()}  # type: ignore[assignment]
    ours.close()
    return times


def summary(xs: List[float]) -> Dict[str, float]:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]  # noqa: E731
    return {"p50_ms": statistics.median(xs) * 1e3, "p10_ms": q(0.1) * 1e3, "p90_ms": q(0.9) * 1e3}


def slope(xs: List[float], ys: List[float]) -> float:
    """Least-squares slope of log(time) on log(cached tokens): 0 = flat, 1 = linear."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den if den else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cached-tokens", type=int, default=1 << 20, help="tokens cached before the main table's timings")
    ap.add_argument("--request-tokens", type=int, default=32 << 10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=4096, help="system-prompt tokens shared by requests")
    ap.add_argument("--repeats", type=int, default=40, help="timed repetitions of each operation")
    ap.add_argument("--token-type", choices=("array", "list"), default="array",
                    help="how requests hold their tokens: array('q') as SGLang 0.5.23's scheduler does, or list")
    ap.add_argument("--scale", default="131072,524288,2097152,8388608",
                    help="cached-token sizes for the growth sweep (comma-separated; empty to skip)")
    ap.add_argument("--scale-repeats", type=int, default=12,
                    help="repetitions per size in the sweep (each insert adds 28K tokens: kept small so a size "
                         "stays that size)")
    ap.add_argument("--out", default="bench/results/tree_ops.json", help="JSON; .md and .png go beside it")
    a = ap.parse_args(argv)
    try:
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    except ImportError as exc:
        print(f"tree_ops needs SGLang 0.5.23 (bash scripts/setup.sh --test): {exc}", file=sys.stderr)
        return 2
    res: Dict[str, object] = {"cached_tokens": a.cached_tokens, "request_tokens": a.request_tokens,
                              "page_size": a.page_size, "token_type": a.token_type, "repeats": a.repeats, "ops": {}}
    times = measure(a.cached_tokens, a, a.repeats)
    res["matched_prefix_tokens"] = times.pop("_matched")  # one value per op: every engine did the same work
    for op in OPS[:3]:
        times[op]["sglang-paged"] = times[op]["sglang-sim"]
    for op in OPS:
        row = {e: summary(times[op][e]) for e in ENGINES}
        for e in ENGINES[1:]:
            row[f"{e}_over_radixtier"] = row[e]["p50_ms"] / row["radixtier"]["p50_ms"]
        res["ops"][op] = row
    sizes = [int(x) for x in a.scale.split(",") if x.strip()]
    growth: Dict[str, Dict[str, List[float]]] = {op: {e: [] for e in ENGINES} for op in OPS}
    for n in sizes:
        t = measure(n, a, a.scale_repeats)
        t.pop("_matched")
        for op in OPS[:3]:
            t[op]["sglang-paged"] = t[op]["sglang-sim"]
        for op in OPS:
            for e in ENGINES:
                growth[op][e].append(summary(t[op][e])["p50_ms"])
    if sizes:
        res["scale"] = {"cached_tokens": sizes, "p50_ms": growth,
                        "slope": {op: {e: slope(sizes, growth[op][e]) for e in ENGINES} for op in OPS}}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"{a.cached_tokens // 1024}K cached tokens, {a.request_tokens // 1024}K-token requests, page {a.page_size}, "
             f"tokens as {a.token_type}; p50 ms (p10-p90) over {a.repeats} interleaved repetitions; ratio = SGLang "
             "time / radixtier time (>= 1: radixtier as fast or faster)", "",
             "| operation | radixtier | SGLang sim (no-op allocator) | ratio | SGLang paged allocator | ratio |",
             "|---|---|---|---:|---|---:|"]
    fmt = lambda s: f"{s['p50_ms']:.3f} ({s['p10_ms']:.3f}-{s['p90_ms']:.3f})"  # noqa: E731
    for op, r in res["ops"].items():
        lines.append(f"| {op} | {fmt(r['radixtier'])} | {fmt(r['sglang-sim'])} | {r['sglang-sim_over_radixtier']:.2f}x "
                     f"| {fmt(r['sglang-paged'])} | {r['sglang-paged_over_radixtier']:.2f}x |")
    if sizes:
        lines += ["", f"Growth with cached tokens (p50 ms over {a.scale_repeats} repetitions; slope of log time on log "
                  "cached tokens: 0 = flat, 1 = linear)", "",
                  "| operation | engine | " + " | ".join(f"{n // 1024}K" for n in sizes) + " | slope |",
                  "|---|---|" + "---:|" * (len(sizes) + 1)]
        for op in OPS:
            for e in ENGINES:
                vals = " | ".join(f"{v:.3f}" for v in growth[op][e])
                lines.append(f"| {op} | {e} | {vals} | {res['scale']['slope'][op][e]:+.2f} |")
    text = "\n".join(lines)
    print(text)
    md, png = os.path.splitext(a.out)[0] + ".md", os.path.splitext(a.out)[0] + ".png"
    with open(md, "w") as f:
        f.write(text + "\n")
    if sizes:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"wrote {a.out}, {md} (matplotlib missing: no plot)")
            return 0
        fig, axes = plt.subplots(1, len(OPS), figsize=(4 * len(OPS), 3.6), sharey=False)
        for ax, op in zip(axes, OPS):
            for e, style in zip(ENGINES, ("o-", "s--", "^:")):
                ax.plot(sizes, growth[op][e], style, label=e)
            ax.set_xscale("log", base=2)
            ax.set_title(op, fontsize=9)
            ax.set_xlabel("cached tokens")
            ax.set_ylim(bottom=0)
        axes[0].set_ylabel("p50 ms")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        print(f"wrote {a.out}, {md}, {png}")
    else:
        print(f"wrote {a.out}, {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
