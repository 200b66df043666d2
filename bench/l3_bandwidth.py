"""Tier-3 read bandwidth, side by side in one run:

  radixtier   NvmeofPageStore.get of N pages (O_DIRECT, coalesced, queue_depth in flight, verified)
  fio         the same file region, same block size and queue depth, direct=1 (the physical limit)
  hicachefile SGLang 0.5.23's HiCacheFile backend (one file per page) reading the same bytes

Targets: radixtier >= 0.85x fio, and >= 5x HiCacheFile.

    python bench/l3_bandwidth.py [--dir DIR] [--ram-device] [--total 1GiB] [--sizes 256KiB,1MiB,4MiB] [--queue-depth 16]

--ram-device first runs everything on a RAM-backed loop device made (and removed) for the run,
where fio is stable, then on --dir's disk; each table row says where, with min-max of the rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from radixtier.cli import parse_bytes
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace
from radixtier.storage.nvmeof.layout import align_up

TARGET_VS_FIO = 0.85
TARGET_VS_HICACHE = 5.0


def drop_caches(paths: List[str]) -> str:
    """Evict the bench files from the page cache, so buffered readers read the device too."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd) if os.access(p, os.W_OK) else None
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        except OSError:
            pass
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def aligned_tensor(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 4096
    return raw[skip:skip + nbytes]


def keys_for(n: int, tag: str) -> List[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


class RadixtierReader:
    """Writes n pages into a fresh namespace once; read_once() times one cold get() of all of them."""

    def __init__(self, path: str, page: int, n: int, qd: int, engine: str, batch: int) -> None:
        capacity = 3 * 4096 + (n + 64) * (4096 + align_up(page) + 64)
        if os.path.exists(path):
            os.remove(path)
        format_namespace(path, page, capacity_bytes=capacity)
        self.path, self.page, self.n, self.batch = path, page, n, batch
        self.store = NvmeofPageStore(path, page, io_engine=engine, queue_depth=qd, sync=False)
        self.keys = keys_for(n, f"p{page}")
        src = [aligned_tensor(page) for _ in range(8)]
        for s in src:
            s.random_(0, 255)
        for i in tqdm(range(0, n, batch), desc=f"write {page >> 10}KiB", file=sys.stderr, leave=False):
            ks = self.keys[i:i + batch]
            assert all(self.store.put(ks, [src[j % len(src)] for j in range(i, i + len(ks))]).ok), "write failed"
        os.sync()
        self.dst = [aligned_tensor(page) for _ in range(batch)]
        sb = self.store.sb
        self.data_offset, self.slot_bytes = sb.data_offset, sb.slot_bytes

    def read_once(self) -> float:
        drop_caches([self.path])
        t = time.perf_counter()
        for i in range(0, self.n, self.batch):
            ks = self.keys[i:i + self.batch]
            assert all(self.store.get(ks, self.dst[:len(ks)])), "bench read failed verification"
        return self.n * self.page / (time.perf_counter() - t)

    def info(self) -> Dict[str, object]:
        st = self.store.stats()
        return {"io_engine": st["io_engine"], "direct_io": st["direct_io"], "bounced": st["bounced"],
                "corrupt": st["corrupt"]}

    def close(self) -> None:
        self.store.close()
        os.remove(self.path)


def fio_once(path: str, offset: int, span: int, bs: int, qd: int) -> Optional[float]:
    """fio sequential direct read of the same region, same block size and queue depth (bytes/s)."""
    if shutil.which("fio") is None:
        return None
    drop_caches([path])
    for engine in ("io_uring", "libaio", "psync"):
        cmd = ["fio", "--name=l3", f"--filename={path}", "--rw=read", f"--bs={bs}", "--direct=1",
               f"--ioengine={engine}", f"--iodepth={qd}", f"--offset={offset}", f"--size={span}",
               "--output-format=json", "--readonly"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode == 0:
            j = json.loads(out.stdout[out.stdout.index("{"):])
            return float(j["jobs"][0]["read"]["bw_bytes"])
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the bench files go (default: a temp dir on /tmp's disk)")
    ap.add_argument("--total", type=parse_bytes, default=parse_bytes("1GiB"), help="bytes read per page size")
    ap.add_argument("--sizes", default="256KiB,1MiB,4MiB")
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    ap.add_argument("--batch-bytes", type=parse_bytes, default=parse_bytes("256MiB"),
                    help="bytes per get() call (a prefetch of a long prefix)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hicache-total", type=parse_bytes, default=None,
                    help="bytes HiCacheFile reads (default: same as --total)")
    ap.add_argument("--ram-device", action="store_true",
                    help="also run on a RAM-backed loop device made for this run (stable figures; needs root)")
    ap.add_argument("--out", default="bench/results/l3_bandwidth.json")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    places = [("disk", a.dir)]
    rows: List[Dict[str, object]] = []
    if a.ram_device:
        from ramdevice import RamDeviceUnavailable, ram_device

        sizes = [parse_bytes(s) for s in a.sizes.split(",")]
        need = max(max(8, a.total // z) * (z + 8192) for z in sizes) * 2 + (a.hicache_total or a.total) + (256 << 20)
        try:
            with ram_device(need) as mount:
                rows += run_place(a, "ram-device", mount)
        except RamDeviceUnavailable as exc:
            print(f"RAM device skipped: {exc}", file=sys.stderr)
    for where, folder in places:
        rows += run_place(a, where, folder)
    report(a, rows)
    return 0


def run_place(a: argparse.Namespace, where: str, folder: Optional[str]) -> List[Dict[str, object]]:
    """One full set of interleaved rounds on one filesystem (a temp dir in `folder`)."""
    work = tempfile.mkdtemp(prefix="radixtier-l3-", dir=folder or ("/var/tmp" if os.path.isdir("/var/tmp") else None))
    rows: List[Dict[str, object]] = []
    try:
        for size in [parse_bytes(s) for s in a.sizes.split(",")]:
            n = max(8, a.total // size)
            batch = max(1, min(n, a.batch_bytes // size))
            ours = RadixtierReader(os.path.join(work, f"ns-{size}.img"), size, n, a.queue_depth, a.engine, batch)
            hic = None
            try:
                from hicache_file_bench import HiCacheFileReader

                hic = HiCacheFileReader(os.path.join(work, f"hicache-{size}"), size,
                                        max(8, (a.hicache_total or a.total) // size))
            except ImportError as exc:
                print(f"HiCacheFile skipped: sglang unavailable ({exc})", file=sys.stderr)
            runs = {"radixtier": [], "fio": [], "hicachefile": []}
            # interleaved, one of each per round: these machines are noisy, so compare like with like
            for _ in tqdm(range(a.reps), desc=f"read {size >> 10}KiB", file=sys.stderr, leave=False):
                runs["radixtier"].append(ours.read_once())
                f = fio_once(ours.path, ours.data_offset, n * ours.slot_bytes, ours.slot_bytes, a.queue_depth)
                if f is not None:
                    runs["fio"].append(f)
                if hic is not None:
                    runs["hicachefile"].append(hic.read_once(drop_caches))
            row = {"where": where, "page_bytes": size, "pages": n, "queue_depth": a.queue_depth,
                   "radixtier_info": ours.info(),
                   "gbps": {k: statistics.median(v) / 1e9 for k, v in runs.items() if v},
                   "runs_gbps": {k: [x / 1e9 for x in v] for k, v in runs.items()}}
            if runs["fio"]:
                row["radixtier_vs_fio"] = statistics.median(r / f for r, f in zip(runs["radixtier"], runs["fio"]))
            if runs["hicachefile"]:
                row["radixtier_vs_hicachefile"] = statistics.median(
                    r / h for r, h in zip(runs["radixtier"], runs["hicachefile"]))
                row["fio_vs_hicachefile"] = statistics.median(
                    f / h for f, h in zip(runs["fio"], runs["hicachefile"])) if runs["fio"] else None
            rows.append(row)
            ours.close()
            if hic is not None:
                hic.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def report(a: argparse.Namespace, rows: List[Dict[str, object]]) -> None:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"targets": {"vs_fio": TARGET_VS_FIO, "vs_hicachefile": TARGET_VS_HICACHE}, "rows": rows}, f, indent=2)
    print(f"{'where':>10s} {'page':>7s} {'radixtier':>10s} {'(min-max)':>11s} {'fio':>8s} {'(min-max)':>11s} "
          f"{'HiCacheFile':>11s} {'vs fio':>7s} {'vs HiCF':>8s} {'fio/HiCF':>8s}  "
          f"(GB/s, medians of {a.reps} interleaved rounds)")
    ok = True
    nan = float("nan")
    for r in rows:
        g = r["gbps"]
        vf, vh = r.get("radixtier_vs_fio", nan), r.get("radixtier_vs_hicachefile", nan)
        fh = r.get("fio_vs_hicachefile") or nan
        ok &= vf >= TARGET_VS_FIO and vh >= TARGET_VS_HICACHE
        spread = {k: (f"{min(v):.2f}-{max(v):.2f}" if v else "-") for k, v in r["runs_gbps"].items()}
        print(f"{r['where']:>10s} {r['page_bytes'] >> 10:5d}Ki {g['radixtier']:10.2f} {spread['radixtier']:>11s} "
              f"{g.get('fio', nan):8.2f} {spread['fio']:>11s} {g.get('hicachefile', nan):11.3f} {vf:6.2f}x "
              f"{vh:7.1f}x {fh:7.1f}x")
    print(f"targets: >= {TARGET_VS_FIO}x fio and >= {TARGET_VS_HICACHE}x HiCacheFile: {'met' if ok else 'NOT met'}")
    print(f"written {a.out}")


if __name__ == "__main__":
    sys.exit(main())
