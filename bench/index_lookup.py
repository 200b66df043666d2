"""Prefix-index lookup latency: a 512-page chain in one round trip (EVALSHA) vs one EXISTS per page.

    python bench/index_lookup.py [--url redis://...] [--pages 512] [--iters 200]

Starts its own redis-server on a free loopback port unless --url is given. Side by side, one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from radixtier.storage.api import PageLocation  # noqa: E402
from radixtier.storage.api import PageRecord  # noqa: E402
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="bench/results/index_lookup.json")
    a = ap.parse_args(argv)
    srv = None
    url = a.url
    if url is None:
        from redis_server import RedisServer

        srv = RedisServer(tempfile.mkdtemp(prefix="radixtier-redis-"))
        url = srv.url
    try:
        cfg = dict(url=url, namespace="bench", lookup_timeout_s=2.0, heartbeat_s=1.0, node_ttl_s=10.0)
        writer = RedisPrefixIndex(RedisIndexConfig(node_id="writer", **cfg))
        reader = RedisPrefixIndex(RedisIndexConfig(node_id="reader", **cfg))
        keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(a.pages)]
        recs = [PageRecord("writer", "storage", PageLocation("ab" * 16, i, i + 1, 1 << 18, i)) for i in range(a.pages)]
        writer.publish(keys[0], keys, recs)
        assert writer.flush(30)
        time.sleep(1.2)  # the writer's heartbeat is visible
        assert len(reader.lookup(keys[0], keys)) == a.pages
        client = reader._reader.client  # noqa: SLF001 - the baseline uses the lookup connection pool
        names = [reader._page_key(keys[0], k) for k in keys]  # noqa: SLF001
        chain, per_key = [], []
        for _ in range(a.iters):  # interleaved: each pair sees the same machine state
            t = time.perf_counter()
            run = reader.lookup(keys[0], keys)
            chain.append(time.perf_counter() - t)
            t = time.perf_counter()
            n = 0
            for name in names:
                if not client.exists(name):
                    break
                n += 1
            per_key.append(time.perf_counter() - t)
            assert len(run) == n == a.pages
        res = {
            "pages": a.pages, "iters": a.iters,
            "chain_lookup_one_round_trip": {"median_ms": statistics.median(chain) * 1e3, "p99_ms": pct(chain, 99) * 1e3},
            "per_key_exists": {"median_ms": statistics.median(per_key) * 1e3, "p99_ms": pct(per_key, 99) * 1e3},
        }
        res["speedup_median"] = res["per_key_exists"]["median_ms"] / res["chain_lookup_one_round_trip"]["median_ms"]
        res["speedup_p99"] = res["per_key_exists"]["p99_ms"] / res["chain_lookup_one_round_trip"]["p99_ms"]
        writer.close()
        reader.close()
    finally:
        if srv is not None:
            srv.stop()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    c, p = res["chain_lookup_one_round_trip"], res["per_key_exists"]
    print(f"{a.pages}-page chain, {a.iters} lookups each, side by side")
    print(f"{'method':28s} {'median ms':>10s} {'p99 ms':>9s}")
    print(f"{'one round trip (EVALSHA)':28s} {c['median_ms']:10.3f} {c['p99_ms']:9.3f}")
    print(f"{'EXISTS per page':28s} {p['median_ms']:10.3f} {p['p99_ms']:9.3f}")
    print(f"speedup: {res['speedup_median']:.1f}x median, {res['speedup_p99']:.1f}x p99; written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
