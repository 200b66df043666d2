"""Tree operation latency: match/insert of 32K-token requests against 1M cached tokens.

    python bench/tree_ops.py [--cached-tokens 1048576] [--request-tokens 32768] [--out bench/results/tree_ops.json]

Measured through TieredKVCache (hashing, tree walk, tier split, pool bookkeeping) with
one-element pages, so the numbers are the tree's cost, not memcpy.
"""

from __future__ import annotations

import argparse
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


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summary(xs):
    return {"p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3, "n": len(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached-tokens", type=int, default=1 << 20)
    ap.add_argument("--request-tokens", type=int, default=32 << 10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--shared-prefix", type=int, default=4096, help="system-prompt tokens shared by requests")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="bench/results/tree_ops.json")
    a = ap.parse_args(argv)
    rng = random.Random(0)
    ps = a.page_size
    pages = a.cached_tokens // ps
    ns = KVNamespace("bench", "int32", "flat", ps)
    cfg = CacheConfig(page_size=ps, page_shape=(1,), dtype=torch.int32, device_pages=pages + (a.repeats + 4) * a.request_tokens // ps,
                      host_pages=16, device="cpu", write_policy="write_back")
    cache = TieredKVCache(cfg, ns)
    systems = [[rng.randrange(32000) for _ in range(a.shared_prefix)] for _ in range(8)]
    cached = []
    total = 0
    with tqdm(total=a.cached_tokens, desc="fill", unit="tok", file=sys.stderr) as bar:
        while total + a.request_tokens <= a.cached_tokens:
            sysp = systems[len(cached) % len(systems)]
            req = sysp + [rng.randrange(32000) for _ in range(a.request_tokens - len(sysp))]
            new = cache.insert(req, torch.zeros(a.request_tokens // ps, 1, dtype=torch.int32))
            total += new * ps
            cached.append(req)
            bar.update(new * ps)
    full_hit, partial, miss, inserts = [], [], [], []
    for i in range(a.repeats):
        req = cached[i % len(cached)]
        t = time.perf_counter(); m = cache.match(req); full_hit.append(time.perf_counter() - t)
        assert m.prefix_tokens == a.request_tokens, (m, len(req))
        half = req[:a.request_tokens // 2] + [rng.randrange(32000) for _ in range(a.request_tokens // 2)]
        t = time.perf_counter(); cache.match(half); partial.append(time.perf_counter() - t)
        cold = [rng.randrange(32000) for _ in range(a.request_tokens)]
        t = time.perf_counter(); cache.match(cold); miss.append(time.perf_counter() - t)
        fresh = systems[i % 8] + [rng.randrange(32000) for _ in range(a.request_tokens - a.shared_prefix)]
        kv = torch.zeros((a.request_tokens - a.shared_prefix) // ps, 1, dtype=torch.int32)
        t = time.perf_counter()
        cache.insert(fresh, kv, first_page=a.shared_prefix // ps)
        inserts.append(time.perf_counter() - t)
    res = {
        "cached_tokens": total, "request_tokens": a.request_tokens, "page_size": ps, "nodes": len(cache.tree),
        "match_full_hit": summary(full_hit), "match_half_hit": summary(partial), "match_miss": summary(miss),
        "insert_new_28k_after_shared_4k": summary(inserts),
    }
    cache.close()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"{'operation':34s} {'p50 ms':>9s} {'p99 ms':>9s}")
    for k in ("match_full_hit", "match_half_hit", "match_miss", "insert_new_28k_after_shared_4k"):
        print(f"{k:34s} {res[k]['p50_ms']:9.3f} {res[k]['p99_ms']:9.3f}")
    print(f"cached tokens {total}, nodes {res['nodes']}, written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
