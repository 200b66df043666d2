"""Prefix-index chain lookup latency, side by side with the round-trip floor, in one run:

  ping             PING on the lookup's own connection (the loopback RTT floor)
  locations        lookup_locations(): what the SGLang backend's batch_exists and reads use
  records          lookup(): every holder's record as objects (the general API)
  batch_exists     SGLang's RadixTierStorage.batch_exists end to end on node B, whose store has none
                   of the pages (backend -> index -> answer), for the chain node A wrote

for a 512-page chain with 1 and with 8 holders (p50/p99 over interleaved iterations; `records`
in a loop of its own, with its own PING floor: its objects slowed whatever came next), then how
lookup time grows with chain length (64 -> 4096 pages) and holders (1 -> 64), with the slope of
each. Targets: p99 < 1 ms with 1 holder, < 2 ms with 8.

    python bench/index_lookup.py [--url redis://...] [--iters 300] [--out bench/results/index_lookup.json]

Starts its own redis-server on a free loopback port unless --url is given. JSON, Markdown and PNG.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))

from radixtier.storage.api import PageLocation, PageRecord  # noqa: E402
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex  # noqa: E402

NS = "ab" * 16
TARGET_P99_MS = {1: 1.0, 8: 2.0}


def pct(xs: List[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def chain(n: int, tag: str = "c") -> List[bytes]:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def _holders_process(url: str, conn) -> None:
    """The holders' side: other nodes' indexes, which publish chains and keep heartbeating. They run
    in a process of their own, as they would on other machines: in the reader's process, their
    threads took the GIL from the timed lookups (8 holders doubled the PING floor's p50)."""
    cfg = dict(url=url, namespace="bench", lookup_timeout_s=2.0, heartbeat_s=1.0, node_ttl_s=30.0)
    writers: List[RedisPrefixIndex] = []
    try:
        for keys, holders in iter(conn.recv, None):
            while len(writers) < holders:
                writers.append(RedisPrefixIndex(RedisIndexConfig(node_id=f"w{len(writers)}", **cfg)))
            for w in writers[:holders]:
                w.publish(keys[0], keys, [PageRecord(w.node_id, "storage", PageLocation(NS, i, i + 1, 1 << 18, i))
                                          for i in range(len(keys))])
            conn.send(all([w.flush(60) for w in writers[:holders]]))
    finally:
        for w in writers:
            w.close()
        conn.send(True)


class Fleet:
    """Holder nodes (a process of their own) that publish chains, and the reader whose lookups are timed."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("fork")  # made before this process starts any thread
        self._conn, theirs = ctx.Pipe()
        self._holders = ctx.Process(target=_holders_process, args=(url, theirs), name="holders", daemon=True)
        self._holders.start()
        self.reader = RedisPrefixIndex(RedisIndexConfig(node_id="reader", url=url, namespace="bench",
                                                        lookup_timeout_s=2.0, heartbeat_s=1.0, node_ttl_s=30.0))

    def publish(self, keys: List[bytes], holders: int) -> None:
        self._conn.send((keys, holders))
        if not self._conn.recv():
            raise RuntimeError(f"the holder nodes could not publish a {len(keys)}-page chain")

    def close(self) -> None:
        self._conn.send(None)
        self._conn.recv()
        self._holders.join(30)
        self.reader.close()


def timed(fns: Dict[str, Callable[[], object]], iters: int) -> Dict[str, List[float]]:
    """Interleaved: each iteration runs every function once, so all see the same machine state."""
    out: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t)
    return out


def sglang_batch_exists(url: str, tmp: str, pages: int):
    """Two SGLang backends on one namespace: A writes a chain, B's batch_exists is timed (or None
    with the reason when SGLang is not installed)."""
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from radixtier.testing.sglang_pools import attach
    except ImportError as exc:
        return None, f"sglang unavailable: {exc}"
    page = 16
    dev = MHATokenToKVPool(pages * page, page, torch.bfloat16, 2, 64, 1, "cpu", False, start_layer=0, end_layer=1,
                           enable_alt_stream=False)

    def host():
        return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
                                    end_layer=1, write_back_staging=dev.hicache_write_back_staging)

    common = {"path": os.path.join(tmp, "ns.img"), "capacity": "128MiB", "redis_url": url, "interface_v1": 1,
              "redis_namespace": "bench-sglang"}
    a = attach(host(), {**common, "node_id": "node-a", "partition": 0})
    b = attach(host(), {**common, "node_id": "node-b", "partition": 1})
    keys, prev = [], "prompt"
    for i in range(pages):
        prev = hashlib.sha256(f"{prev}/{i}".encode()).hexdigest()
        keys.append(prev)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert all(a.batch_set_v1(keys, torch.arange(0, pages * page, dtype=torch.int64), info))
    assert a.flush(30)
    time.sleep(1.2)
    assert b.batch_exists(keys, info) == pages, "node B does not see node A's chain"
    return (a, b, lambda: b.batch_exists(keys, info)), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--url", default=None, help="an existing Redis (default: start a redis-server for the run)")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default="bench/results/index_lookup.json", help="JSON; .md and .png go beside it")
    a = ap.parse_args(argv)
    srv = None
    url = a.url
    tmp = tempfile.mkdtemp(prefix="radixtier-index-bench-")
    if url is None:
        from radixtier.testing.redis_server import RedisServer

        srv = RedisServer(tmp)
        url = srv.url
    res: Dict[str, object] = {"pages": a.pages, "iters": a.iters, "rows": [], "scale_pages": [], "scale_holders": []}
    fleet = Fleet(url)
    r = fleet.reader
    ping = r._reader.client.ping  # noqa: SLF001 - the floor is measured on the lookup's own connection
    try:
        for holders in (1, 8):
            keys = chain(a.pages, f"h{holders}-")
            fleet.publish(keys, holders)
            time.sleep(1.2)  # writers' heartbeats visible
            assert len(r.lookup_locations(keys[0], keys, NS)) == a.pages
            fns = {"ping": ping, "locations": lambda k=keys: r.lookup_locations(k[0], k, NS)}
            backends = None
            if holders == 1:
                got, why = sglang_batch_exists(url, tmp, a.pages)
                if got is None:
                    print(f"batch_exists skipped: {why}", file=sys.stderr)
                else:
                    backends = got[:2]
                    fns["batch_exists"] = got[2]
            # as README advises an SGLang operator (its /freeze_gc): the heap built so far (SGLang, torch)
            # leaves the collector's generations, so a collection does not walk it inside a timing
            gc.collect()
            gc.freeze()
            try:
                times = timed(fns, a.iters)
                # `records` (the general API: thousands of objects per call) has a loop of its own, with
                # its own PING floor: interleaved, the allocator and collector state it leaves behind
                # slowed the next calls (8 holders: locations p50 0.84 -> 1.43 ms, PING 0.15 -> 0.33 ms)
                own = timed({"ping": ping, "records": lambda k=keys: r.lookup(k[0], k)}, a.iters)
                times["ping (records loop)"], times["records"] = own["ping"], own["records"]
            finally:
                gc.unfreeze()
            for name, xs in times.items():
                res["rows"].append({"holders": holders, "what": name, "p50_ms": statistics.median(xs) * 1e3,
                                    "p99_ms": pct(xs, 99) * 1e3})
            if backends:
                for bk in backends:
                    bk.close()
        for n in (64, 256, 1024, 4096):
            keys = chain(n, f"len{n}-")
            fleet.publish(keys, 1)
            time.sleep(1.2)
            t = timed({"ping": ping, "locations": lambda k=keys: r.lookup_locations(k[0], k, NS)}, 100)
            res["scale_pages"].append({"pages": n, "p50_ms": statistics.median(t["locations"]) * 1e3,
                                       "ping_ms": statistics.median(t["ping"]) * 1e3})
        for h in (1, 4, 16, 64):
            keys = chain(a.pages, f"hold{h}-")
            fleet.publish(keys, h)
            time.sleep(1.2)
            t = timed({"ping": ping, "locations": lambda k=keys: r.lookup_locations(k[0], k, NS)}, 100)
            res["scale_holders"].append({"holders": h, "p50_ms": statistics.median(t["locations"]) * 1e3,
                                         "ping_ms": statistics.median(t["ping"]) * 1e3})
    finally:
        fleet.close()
        if srv is not None:
            srv.stop()
    report(a, res)
    return 0


def slope(xs: List[float], ys: List[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def report(a: argparse.Namespace, res: Dict[str, object]) -> None:
    sp, sh = res["scale_pages"], res["scale_holders"]
    res["us_per_page"] = slope([r["pages"] for r in sp], [r["p50_ms"] * 1e3 for r in sp])
    res["us_per_holder"] = slope([r["holders"] for r in sh], [r["p50_ms"] * 1e3 for r in sh])
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"{a.pages}-page chain, {a.iters} interleaved iterations:", "",
             "| holders | what | p50 ms | p99 ms | target p99 |", "|---:|---|---:|---:|---|"]
    for r in res["rows"]:
        target = TARGET_P99_MS.get(r["holders"]) if r["what"] == "locations" else None
        t = f"< {target} ms: {'met' if r['p99_ms'] < target else 'not met'}" if target else ""
        lines.append(f"| {r['holders']} | {r['what']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {t} |")
    lines += ["", "| chain pages | lookup p50 ms | ping p50 ms |", "|---:|---:|---:|"]
    lines += [f"| {r['pages']} | {r['p50_ms']:.3f} | {r['ping_ms']:.3f} |" for r in sp]
    lines += ["", "| holders | lookup p50 ms | ping p50 ms |", "|---:|---:|---:|"]
    lines += [f"| {r['holders']} | {r['p50_ms']:.3f} | {r['ping_ms']:.3f} |" for r in sh]
    lines += ["", f"slope: {res['us_per_page']:.2f} us per chain page (linear); {res['us_per_holder']:.1f} us per "
              f"holder (flat above 16: writers keep at most 16 holders per page)"]
    table = "\n".join(lines)
    md, png = os.path.splitext(a.out)[0] + ".md", os.path.splitext(a.out)[0] + ".png"
    with open(md, "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {a.out}, {md} (matplotlib missing: no plot)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot([r["pages"] for r in sp], [r["p50_ms"] for r in sp], "o-", label="lookup_locations p50")
    ax1.plot([r["pages"] for r in sp], [r["ping_ms"] for r in sp], "s--", label="PING (RTT floor)")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("chain length (pages)")
    ax1.set_ylabel("ms")
    ax1.set_title(f"lookup vs chain length ({res['us_per_page']:.2f} us/page)")
    ax1.legend()
    ax2.plot([r["holders"] for r in sh], [r["p50_ms"] for r in sh], "o-", label="lookup_locations p50")
    ax2.plot([r["holders"] for r in sh], [r["ping_ms"] for r in sh], "s--", label="PING (RTT floor)")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel(f"holders per page ({a.pages}-page chain)")
    ax2.set_title("lookup vs holders")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {a.out}, {md}, {png}")


if __name__ == "__main__":
    sys.exit(main())
