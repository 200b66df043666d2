"""Tree operations side by side with SGLang 0.5.23's own RadixCache, in one process, interleaved:

  match full hit / half hit / miss of 32K-token requests against 1M cached tokens (32K requests
  sharing 4K system prompts), insert of 28K new tokens after a shared 4K prefix, evict 32K tokens.

radixtier runs as the embedded engine does (TieredKVCache: token conversion, tree walk, tier split,
pool bookkeeping; one-element pages so the numbers are the tree's cost, not memcpy); SGLang as its
scheduler does (RadixCache.create_simulated(page_size=16) with a no-op allocator).

    python bench/tree_ops.py [--cached-tokens 1048576] [--request-tokens 32768] [--repeats 30]
"""

from __future__ import annotations

import argparse
from array import array
import json
import os
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from radixtier.cache import CacheConfig, TieredKVCache
from radixtier.hashing import KVNamespace
from radixtier.tiers import Tier


class _NoFreeAllocator:
    """What RadixCache.create_simulated needs of an allocator when it evicts."""

    device = "cpu"

    def free(self, *args, **kwargs) -> None:
        pass

    def free_segment(self, *args, **kwargs) -> None:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cached-tokens", type=int, default=1 << 20)
    ap.add_argument("--request-tokens", type=int, default=32 << 10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=4096, help="system-prompt tokens shared by requests")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--token-type", choices=("array", "list"), default="array",
                    help="how requests hold their tokens: array('q') as SGLang 0.5.23's scheduler does, or list")
    ap.add_argument("--out", default="bench/results/tree_ops.json")
    a = ap.parse_args(argv)
    try:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except ImportError as exc:
        print(f"tree_ops needs SGLang 0.5.23 (bash scripts/setup.sh --test): {exc}", file=sys.stderr)
        return 2
    rng = random.Random(0)
    ps, rt, shared = a.page_size, a.request_tokens, a.shared_prefix
    tok = (lambda xs: array("q", xs)) if a.token_type == "array" else list
    ns = KVNamespace("bench", "int32", "flat", ps)
    cfg = CacheConfig(page_size=ps, page_shape=(1,), dtype=torch.int32,
                      device_pages=(a.cached_tokens + (a.repeats + 4) * rt) // ps, host_pages=16, device="cpu",
                      write_policy="write_back")
    ours = TieredKVCache(cfg, ns)
    theirs = RadixCache.create_simulated(mock_allocator=_NoFreeAllocator(), page_size=ps)
    systems = [[rng.randrange(32000) for _ in range(shared)] for _ in range(8)]
    cached, pos = [], 0
    for i in tqdm(range(a.cached_tokens // rt), desc="fill", file=sys.stderr):
        req = tok(systems[i % 8] + [rng.randrange(32000) for _ in range(rt - shared)])
        ours.insert(req, torch.zeros(rt // ps, 1, dtype=torch.int32))
        theirs.insert(InsertParams(key=RadixKey(req, None), value=torch.arange(pos, pos + rt, dtype=torch.int64)))
        pos += rt
        cached.append(req)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    ops = ("match_full_hit", "match_half_hit", "match_miss", "insert_28k_after_shared_4k", "evict_32k")
    times = {op: {"radixtier": [], "sglang": []} for op in ops}
    for i in tqdm(range(a.repeats), desc="ops", file=sys.stderr):
        req = cached[i % len(cached)]
        half = req[:rt // 2] + tok([rng.randrange(32000) for _ in range(rt // 2)])
        cold = tok([rng.randrange(32000) for _ in range(rt)])
        fresh = tok(systems[i % 8] + [rng.randrange(32000) for _ in range(rt - shared)])
        kv = torch.zeros((rt - shared) // ps, 1, dtype=torch.int32)
        pairs = {
            "match_full_hit": (lambda: ours.match(req), lambda: theirs.match_prefix(MatchPrefixParams(key=RadixKey(req, None)))),
            "match_half_hit": (lambda: ours.match(half), lambda: theirs.match_prefix(MatchPrefixParams(key=RadixKey(half, None)))),
            "match_miss": (lambda: ours.match(cold), lambda: theirs.match_prefix(MatchPrefixParams(key=RadixKey(cold, None)))),
            "insert_28k_after_shared_4k": (
                lambda: ours.insert(fresh, kv, first_page=shared // ps),
                lambda: theirs.insert(InsertParams(key=RadixKey(fresh, None),
                                                   value=torch.arange(pos, pos + rt, dtype=torch.int64)))),
            "evict_32k": (lambda: ours.evict(Tier.DEVICE, rt // ps), lambda: theirs.evict(EvictParams(num_tokens=rt))),
        }
        for op in ops:  # interleaved: both see the same machine state
            f_ours, f_theirs = pairs[op]
            if i % 2:
                times[op]["sglang"].append(timed(f_theirs))
                times[op]["radixtier"].append(timed(f_ours))
            else:
                times[op]["radixtier"].append(timed(f_ours))
                times[op]["sglang"].append(timed(f_theirs))
        pos += rt
    ours.close()
    res = {"cached_tokens": a.cached_tokens, "request_tokens": rt, "page_size": ps, "ops": {}}
    for op in ops:
        o, t = statistics.median(times[op]["radixtier"]), statistics.median(times[op]["sglang"])
        res["ops"][op] = {"radixtier_p50_ms": o * 1e3, "sglang_p50_ms": t * 1e3, "ratio_sglang_over_radixtier": t / o}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print("| operation | radixtier p50 ms | SGLang RadixCache p50 ms | SGLang / radixtier (>= 1: radixtier as fast) |")
    print("|---|---:|---:|---:|")
    for op, r in res["ops"].items():
        print(f"| {op} | {r['radixtier_p50_ms']:.3f} | {r['sglang_p50_ms']:.3f} | {r['ratio_sglang_over_radixtier']:.2f}x |")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
