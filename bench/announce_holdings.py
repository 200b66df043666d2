"""What announcing a restarted worker's tier 3 costs: how long until a router knows what the
partition holds, and what the announcement costs the reads serving the first requests meanwhile.

For each size (default 10,000 and 1,000,000 pages) a namespace on a RAM-backed loop device (ext4,
O_DIRECT; a /dev/shm file without root) is filled with tagged pages -- chains of 16 pages, 64
token ids each, as the SGLang backend writes them -- and reopened as after a restart. Then:
  order      announce_order over the partition's slot table (numpy; parents first)
  read       NvmeofPageStore.router_tags: every header read and proven, batches of 256
  announce   Tier3Events with a null publisher, from open until every page was announced (the
             events thread builds SGLang's BlockStored; the announcing thread rests as long as each
             batch took: at most half a core)
  reads      p50/p99 of a 64-page verified read (store.get) while the announcement runs, against
             the same reads with nothing else running, interleaved (--reps rounds of each)
The announcement never delays SGLang's start: it runs on threads of its own after the stream opens.

    python bench/announce_holdings.py [--pages 10000 1000000] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

import numpy as np
import torch
from tqdm import tqdm

PAGE_BYTES = 4096
TOKENS = 64
CHAIN = 16
READ_BATCH = 64


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "little")


def fill(path: str, pages: int) -> None:
    from radixtier.storage.nvmeof.store import NvmeofPageStore

    from radixtier.storage.nvmeof.layout import BLOCK
    need = (pages + 4096) * (PAGE_BYTES + BLOCK + 64) + (1 << 20)
    with NvmeofPageStore(path, PAGE_BYTES, create_bytes=need) as s:
        buf = torch.zeros(PAGE_BYTES // 4)
        batch = 256
        for first in tqdm(range(0, pages, batch), desc=f"fill {pages:,} pages", unit="batch", leave=False):
            n = min(batch, pages - first)
            keys = [key(first + j) for j in range(n)]
            parents = [None if (first + j) % CHAIN == 0 else key(first + j - 1) for j in range(n)]
            tags = [(first + j, None if (first + j) % CHAIN == 0 else first + j - 1,
                     list(range(((first + j) * TOKENS) % 100_000, ((first + j) * TOKENS) % 100_000 + TOKENS)))
                    for j in range(n)]
            assert all(s.put(keys, [buf] * n, parents, tags).ok)


def read_latencies(store, pages: int, n: int, stop: threading.Event | None) -> list:
    out, bufs = [], [torch.empty(PAGE_BYTES // 4) for _ in range(READ_BATCH)]
    rng = np.random.default_rng(1)
    for _ in range(n):
        if stop is not None and stop.is_set():
            break
        first = int(rng.integers(0, max(1, pages - READ_BATCH)))
        t0 = time.perf_counter()
        ok = store.get([key(first + j) for j in range(READ_BATCH)], bufs)
        out.append((time.perf_counter() - t0) * 1000)
        assert all(ok)
    return out


def measure(path: str, pages: int, reps: int) -> dict:
    from radixtier.integrations.sglang.events.kv_events import Tier3Events
    from radixtier.storage.nvmeof.store import NvmeofPageStore
    from radixtier.storage.nvmeof.tags import announce_order

    row = {"pages": pages}
    with NvmeofPageStore(path, PAGE_BYTES) as s:
        table, first = s._slots.table_copy()
        t0 = time.perf_counter()
        order = announce_order(table, first)
        row["order_s"] = round(time.perf_counter() - t0, 3)
        assert len(order) == pages
        t0 = time.perf_counter()
        named = sum(len(b) for b in s.router_tags())
        row["read_s"] = round(time.perf_counter() - t0, 3)
        assert named == pages
        announce, idle, during = [], [], []
        for _rep in range(reps):
            idle += read_latencies(s, pages, 50, None)
            published = [0]

            def publish(batch) -> None:
                published[0] += sum(len(e.block_hashes) for e in batch.events)
            t0 = time.perf_counter()
            ev = Tier3Events(publish, TOKENS, joined=False, holdings=s.router_tags, announce_after_s=0.0)
            stop = threading.Event()
            reader = threading.Thread(target=lambda: during.extend(read_latencies(s, pages, 10 ** 9, stop)))
            reader.start()
            assert ev.flush(3600)
            announce.append(time.perf_counter() - t0)
            stop.set()
            reader.join()
            assert published[0] == pages, published[0]
            ev.close()
        row["announce_s"] = [round(x, 2) for x in announce]
        row["announce_pages_per_s"] = round(pages / statistics.median(announce))
        for name, lat in (("read_idle_ms", idle), ("read_during_ms", during)):
            row[name] = {"p50": round(float(np.percentile(lat, 50)), 2), "p99": round(float(np.percentile(lat, 99)), 2),
                         "n": len(lat)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[10_000, 1_000_000], help="namespace sizes, in pages")
    ap.add_argument("--reps", type=int, default=3, help="announcements per size (each with its reads)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    a = ap.parse_args(argv)
    rows = []
    for pages in a.pages:
        need = int((pages + 4096) * (PAGE_BYTES + 4096 + 64) * 1.12) + (256 << 20)  # ext4's own share
        with ExitStack() as stack:
            try:
                from ramdevice import ram_device
                where = stack.enter_context(ram_device(need))
                kind = "RAM-backed loop device (ext4, O_DIRECT)"
            except Exception as exc:  # RamDeviceUnavailable, or not root
                where = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm"))
                kind = f"/dev/shm file ({exc})"
            path = os.path.join(where, "ns.img")
            fill(path, pages)
            row = measure(path, pages, a.reps)
            row["target"] = kind
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{platform.node()} {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, python bench/announce_holdings.py "
          f"--pages {' '.join(map(str, a.pages))} --reps {a.reps}")
    print("| pages | order | read all tags | announce (median; all) | pages/s | 64-page read p50/p99 idle | during |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pages']:,} | {r['order_s']} s | {r['read_s']} s | {statistics.median(r['announce_s']):.2f} s; "
              f"{r['announce_s']} | {r['announce_pages_per_s']:,} | {r['read_idle_ms']['p50']}/{r['read_idle_ms']['p99']} ms"
              f" | {r['read_during_ms']['p50']}/{r['read_during_ms']['p99']} ms |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
