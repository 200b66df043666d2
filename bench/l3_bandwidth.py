"""Tier-3 bandwidth, side by side in one run (interleaved rounds, medians with min-max):

  reads        NvmeofPageStore.get of N pages (O_DIRECT, coalesced, queue_depth in flight, every page
               proven: slot header + CRC-32C included in the time), per page size
  layer_first  the same for SGLang's layer_first v1 pattern: each page is 2 x layers chunks scattered
               in a layer-first host pool (Llama-8B: 32 layers x K/V x 128 KiB per 8 MiB page)
  writes       NvmeofPageStore.put with fdatasync before pages are indexed (as shipped)
  readers      8 processes (a TP8 node), each reading its own partition of one namespace at once

radixtier reads into a host pool on transparent huge pages (radixtier.hostmem, as the embedded host
pool is); the reads part also times the same reads into 4 KiB-page memory (one allocation per page),
side by side, since that memory cost 15-27% at 256 KiB-1 MiB on the RAM device. Both are registered
with io_uring as fixed buffers, as the embedded cache and the SGLang backend register their host
pools: segments of 256 KiB and more are read with READ_FIXED (raw below stays plain readv).

References, on the same file and bytes:
  fio          same block size (one slot) and queue depth, direct=1; writes with --fdatasync every
               batch; readers with numjobs=8. fio reads into a few cache-hot buffers.
  raw          unverified io_uring reads of the same slots into the same destination buffers as
               radixtier (header to scratch, payload to the page): what the memory the pages land
               in allows, with no index, no proof and no Python per page; and the same into queue-depth
               page buffers used round robin, cache-hot like fio's (raw vs fio with the memory held equal).
  hicachefile  SGLang 0.5.23's HiCacheFile (one file per page) reading the same page bytes.

    python bench/l3_bandwidth.py [--ram-device] [--dir DIR] [--sizes 64KiB,...,8MiB] [--reps 5]
                                 [--parts reads,layer_first,writes,readers] [--out bench/results/l3_bandwidth.json]

--ram-device runs everything on a RAM-backed loop device made (and removed) for the run, where fio
is stable, then on --dir's disk (skip the disk with --no-disk). Writes JSON, a Markdown table and a PNG.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from radixtier.cli import parse_bytes
from radixtier.hostmem import host_memory
from radixtier.storage.nvmeof.io_engine import aligned_buffer
from radixtier.storage.nvmeof.layout import BLOCK, align_up
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace

TARGET_READ_VS_FIO = 0.95
TARGET_WRITE_VS_FIO = 0.9
TARGET_READERS_VS_FIO = 0.9
LAYERS = 32  # layer_first: Llama-8B's 32 layers, K and V


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


def _fio(args: List[str]) -> Optional[dict]:
    if shutil.which("fio") is None:
        return None
    for engine in ("io_uring", "libaio", "psync"):
        out = subprocess.run(["fio", "--name=l3", f"--ioengine={engine}", "--direct=1", "--output-format=json"] + args,
                             capture_output=True, text=True)
        if out.returncode == 0:
            return json.loads(out.stdout[out.stdout.index("{"):])
    return None


def fio_once(path: str, offset: int, span: int, bs: int, qd: int) -> Optional[float]:
    """fio sequential direct read of the same region, same block size and queue depth (bytes/s)."""
    drop_caches([path])
    j = _fio([f"--filename={path}", "--rw=read", f"--bs={bs}", f"--iodepth={qd}", f"--offset={offset}",
              f"--size={span}", "--readonly"])
    return None if j is None else float(j["jobs"][0]["read"]["bw_bytes"])


def fio_write_once(path: str, span: int, bs: int, qd: int, sync_every: int) -> Optional[float]:
    """fio direct writes of `span` bytes, fdatasync every `sync_every` writes (radixtier syncs once per batch)."""
    j = _fio([f"--filename={path}", "--rw=write", f"--bs={bs}", f"--iodepth={qd}", f"--size={span}",
              f"--fdatasync={sync_every}", "--end_fsync=1"])
    return None if j is None else float(j["jobs"][0]["write"]["bw_bytes"])


def fio_readers_once(path: str, offset: int, span_each: int, bs: int, qd: int, jobs: int) -> Optional[float]:
    """fio numjobs=`jobs`, each reading its own `span_each` region (like one partition per process)."""
    drop_caches([path])
    j = _fio([f"--filename={path}", "--rw=read", f"--bs={bs}", f"--iodepth={qd}", f"--offset={offset}",
              f"--size={span_each}", f"--offset_increment={span_each}", f"--numjobs={jobs}", "--group_reporting",
              "--readonly"])
    return None if j is None else float(j["jobs"][0]["read"]["bw_bytes"])


class Namespace:
    """n pages in a fresh namespace; timed cold reads (verified), raw reads and writes of them."""

    def __init__(self, path: str, page: int, n: int, qd: int, engine: str, batch: int, layer_first: bool) -> None:
        capacity = 3 * 4096 + (n + 64) * (4096 + align_up(page) + 64)
        if os.path.exists(path):
            os.remove(path)
        format_namespace(path, page, capacity_bytes=capacity)
        self.path, self.page, self.n, self.batch, self.qd = path, page, n, batch, qd
        self.store = NvmeofPageStore(path, page, io_engine=engine, queue_depth=qd, sync=True)
        self.keys = keys_for(n, f"p{page}")
        self.src = [aligned_tensor(page) for _ in range(4)]
        for s in self.src:
            s.random_(0, 255)
        self.write_once()
        self.layer_first = layer_first
        self._dsts: Dict[bool, list] = {}
        self._regions: List[Tuple[int, int]] = []  # every destination, registered with the store
        sb = self.store.sb
        self.data_offset, self.slot_bytes = sb.data_offset, sb.slot_bytes
        self._raw_ops: Dict[bool, list] = {}

    def _dst(self, huge: bool = True) -> list:
        """Destination pages, made once, in a host pool: whole pages, or SGLang's layer_first v1
        pattern -- one page is K and V of every layer, each a chunk of a layer-first pool
        [2, layers, batch, chunk]. huge: the pool is radixtier.hostmem's (transparent huge pages,
        as the embedded host pool's); else the allocator's 4 KiB pages, one allocation per page."""
        if huge in self._dsts:
            return self._dsts[huge]
        if self.layer_first:
            chunk = self.page // (2 * LAYERS)
            pool = host_memory(2 * LAYERS * self.batch * chunk).view(2, LAYERS, self.batch, chunk)
            dst = [[pool[kv, layer, i] for kv in range(2) for layer in range(LAYERS)] for i in range(self.batch)]
            self._regions.append((pool.data_ptr(), pool.numel()))
        elif huge:
            pool = host_memory(self.batch * self.page)
            dst = [pool[i * self.page:(i + 1) * self.page] for i in range(self.batch)]
            self._regions.append((pool.data_ptr(), pool.numel()))
        else:  # faulted in before any timed read, as a serving host pool is (host_memory's already are)
            dst = [aligned_tensor(self.page).zero_() for _ in range(self.batch)]
            self._regions += [(d.data_ptr(), d.numel()) for d in dst]
        # registered with io_uring once, as the embedded cache and the SGLang backend register their
        # host pools (segments >= 256 KiB are then read with READ_FIXED; `raw` stays plain readv)
        self.store.register_memory(self._regions)
        self._dsts[huge] = dst
        return dst

    def read_once(self, huge: bool = True) -> float:
        dst = self._dst(huge)
        drop_caches([self.path])
        t = time.perf_counter()
        for i in range(0, self.n, self.batch):
            ks = self.keys[i:i + self.batch]
            assert all(self.store.get(ks, dst[:len(ks)])), "bench read failed verification"
        return self.n * self.page / (time.perf_counter() - t)

    def raw_once(self, like_fio: bool = False) -> Optional[float]:
        """Unverified reads of the same slots (io_uring, same queue depth) into the same buffers as
        radixtier -- or, like_fio, into queue-depth page buffers used round robin, cache-hot as
        fio's: the gap between the two is what the memory the pages land in costs, not software."""
        if not self.store._engine.native_pages:
            return None
        from radixtier.storage.api import buffer_view

        if like_fio not in self._raw_ops:
            if like_fio:  # kept on self: the ops below hold bare addresses of these tensors
                self._fio_like = [host_memory(self.page) for _ in range(self.qd)]
                dst = [self._fio_like[j % self.qd] for j in range(self.batch)]
            else:
                dst = self._dst()
            hdr, fd = aligned_buffer(BLOCK), self.store._t.fd
            self._raw_ops[like_fio] = []
            for i in range(0, self.n, self.batch):
                ops = []
                for j, k in enumerate(self.keys[i:i + self.batch]):
                    page = dst[j] if isinstance(dst[j], list) else [dst[j]]
                    ops.append((False, fd, self.store.sb.slot_offset(self.store.location(k).slot),
                                [hdr] + [buffer_view(p) for p in page]))
                self._raw_ops[like_fio].append(ops)
        ring = self.store._engine._ring()
        drop_caches([self.path])
        t = time.perf_counter()
        for ops in self._raw_ops[like_fio]:
            assert all(r > 0 for r in ring.run(ops)), "raw read failed"
        return self.n * self.page / (time.perf_counter() - t)

    def write_once(self) -> float:
        self.store.clear()
        t = time.perf_counter()
        for i in range(0, self.n, self.batch):
            ks = self.keys[i:i + self.batch]
            assert all(self.store.put(ks, [self.src[j % len(self.src)] for j in range(i, i + len(ks))]).ok), \
                "write failed"
        return self.n * self.page / (time.perf_counter() - t)

    def info(self) -> Dict[str, object]:
        st = self.store.stats()
        return {"io_engine": st["io_engine"], "direct_io": st["direct_io"], "corrupt": st["corrupt"]}

    def close(self) -> None:
        self.store.close()
        os.remove(self.path)


def _reader_proc(path: str, page: int, part: int, n: int, batch: int, qd: int, ready, go, out) -> None:
    """One rank: write its partition's pages, then (after the drop) read them all back, timed."""
    store = NvmeofPageStore(path, page, partition=part, node_id=f"rank{part}", queue_depth=qd, sync=False)
    keys = keys_for(n, f"r{part}")
    src = aligned_buffer(page)
    src[:] = os.urandom(page)
    for i in range(0, n, batch):
        assert all(store.put(keys[i:i + batch], [src] * len(keys[i:i + batch])).ok)
    buf = host_memory(batch * page)  # zeroed, so faulted in before the timed read, as a serving host pool is
    dst = [buf[j * page:(j + 1) * page] for j in range(batch)]
    ready.put(part)
    go.wait()
    t0 = time.monotonic()
    for i in range(0, n, batch):
        ks = keys[i:i + batch]
        assert all(store.get(ks, dst[:len(ks)])), "rank read failed verification"
    out.put((t0, time.monotonic()))
    store.close()


class ManyReaders:
    """`procs` processes, one partition each, reading one namespace at once (a TP node's ranks)."""

    def __init__(self, path: str, page: int, n_each: int, qd: int, procs: int) -> None:
        self.path, self.page, self.n_each, self.qd, self.procs = path, page, n_each, qd, procs
        slots = -(-n_each // 64) * 64 * procs  # each partition holds whole 64-entry table blocks
        if os.path.exists(path):
            os.remove(path)
        self.sb = format_namespace(path, page, partitions=procs,
                                   capacity_bytes=4096 * (3 + procs) + slots * (4096 + align_up(page) + 64) + 4096)
        self.n_each = len(self.sb.partition_range(0))  # every slot written: fio reads no holes
        self.batch = max(1, min(n_each, (64 << 20) // page))

    def read_once(self) -> tuple:
        """(radixtier bytes/s, fio bytes/s or None): the ranks read at once, then fio numjobs=procs
        reads the same partitions' slots; a fresh namespace is made for the next round."""
        ctx = mp.get_context("fork")
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        ps = [ctx.Process(target=_reader_proc, args=(self.path, self.page, p, self.n_each, self.batch, self.qd,
                                                     ready, go, out)) for p in range(self.procs)]
        for p in ps:
            p.start()
        for _ in ps:
            ready.get(timeout=300)
        drop_caches([self.path])
        go.set()
        spans = [out.get(timeout=300) for _ in ps]
        for p in ps:
            p.join()
        ours = self.procs * self.n_each * self.page / (max(e for _, e in spans) - min(s for s, _ in spans))
        sb = self.sb
        theirs = fio_readers_once(self.path, sb.data_offset, len(sb.partition_range(0)) * sb.slot_bytes,
                                  sb.slot_bytes, self.qd, self.procs)
        os.remove(self.path)
        self.__init__(self.path, self.page, self.n_each, self.qd, self.procs)
        return ours, theirs

    def close(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def _spread(v: List[float]) -> str:
    return f"{min(v) / 1e9:.2f}-{max(v) / 1e9:.2f}" if v else "-"


def _row(where: str, part: str, page: int, runs: Dict[str, List[float]], extra: Dict[str, object]) -> Dict[str, object]:
    row = {"where": where, "part": part, "page_bytes": page,
           "gbps": {k: statistics.median(v) / 1e9 for k, v in runs.items() if v},
           "runs_gbps": {k: [x / 1e9 for x in v] for k, v in runs.items()}}
    for ref in ("fio", "raw", "hicachefile"):
        if runs.get(ref) and runs.get("radixtier"):
            row[f"vs_{ref}"] = statistics.median(r / f for r, f in zip(runs["radixtier"], runs[ref]))
    if runs.get("radixtier_4k") and runs.get("fio"):  # the same reads into 4 KiB-page memory
        row["radixtier_4k_vs_fio"] = statistics.median(r / f for r, f in zip(runs["radixtier_4k"], runs["fio"]))
    if runs.get("raw_fio_buffers") and runs.get("fio"):  # the I/O path itself against fio, same memory
        row["raw_fio_buffers_vs_fio"] = statistics.median(r / f for r, f in zip(runs["raw_fio_buffers"], runs["fio"]))
    row.update(extra)
    return row


def run_place(a: argparse.Namespace, where: str, folder: Optional[str]) -> List[Dict[str, object]]:
    """Every part on one filesystem (a temp dir in `folder`), rounds interleaved per measurement."""
    work = tempfile.mkdtemp(prefix="radixtier-l3-", dir=folder or ("/var/tmp" if os.path.isdir("/var/tmp") else None))
    parts = a.parts.split(",")
    rows: List[Dict[str, object]] = []
    try:
        sizes = [parse_bytes(s) for s in a.sizes.split(",")]
        jobs = [("reads", z) for z in sizes if "reads" in parts] + \
               [("layer_first", parse_bytes("8MiB"))] * ("layer_first" in parts) + \
               [("writes", z) for z in sizes if "writes" in parts] + \
               [("readers", parse_bytes(a.readers_page))] * ("readers" in parts)
        for part, size in jobs:
            rows.append(measure(a, where, work, part, size))
            r = rows[-1]
            print(f"  {where} {part} {size >> 10} KiB: " + ", ".join(f"{k} {v:.2f}" for k, v in r["gbps"].items())
                  + " GB/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def measure(a: argparse.Namespace, where: str, work: str, part: str, size: int) -> Dict[str, object]:
    runs: Dict[str, List[float]] = {"radixtier": [], "radixtier_4k": [], "fio": [], "raw": [], "raw_fio_buffers": [],
                                    "hicachefile": []}
    if part == "readers":
        n_each = max(64, a.readers_total // size // a.procs // 64 * 64)
        mr = ManyReaders(os.path.join(work, "readers.img"), size, n_each, a.queue_depth, a.procs)
        try:
            for _ in tqdm(range(a.reps), desc=f"{a.procs} readers {size >> 10}KiB", file=sys.stderr, leave=False):
                ours, f = mr.read_once()
                runs["radixtier"].append(ours)
                if f is not None:
                    runs["fio"].append(f)
        finally:
            mr.close()
        return _row(where, part, size, runs, {"procs": a.procs, "pages_each": n_each, "queue_depth": a.queue_depth})
    n = max(8, a.total // size)
    batch = max(1, min(n, a.batch_bytes // size))
    ns = Namespace(os.path.join(work, f"ns-{size}.img"), size, n, a.queue_depth, a.engine, batch,
                   layer_first=(part == "layer_first"))
    hic = None
    if part == "reads" and not a.no_hicachefile:
        try:
            from hicache_file_bench import HiCacheFileReader

            hic = HiCacheFileReader(os.path.join(work, f"hicache-{size}"), size, max(8, a.hicache_total // size))
        except ImportError as exc:
            print(f"HiCacheFile skipped: sglang unavailable ({exc})", file=sys.stderr)
    fio_file = os.path.join(work, "fio-write.img")
    os.sync()  # the setup's buffered writes (HiCacheFile's files) are written back now, not during a timed round
    if part == "writes":  # untimed, as radixtier's first write in Namespace(): both then overwrite allocated blocks
        fio_write_once(fio_file, n * ns.slot_bytes, ns.slot_bytes, a.queue_depth, batch)
    else:
        ns.read_once()  # untimed: one-time costs of a process's first read are paid here, not in round 1
    try:
        for _ in tqdm(range(a.reps), desc=f"{part} {size >> 10}KiB", file=sys.stderr, leave=False):
            if part == "writes":
                runs["radixtier"].append(ns.write_once())
                f = fio_write_once(fio_file, n * ns.slot_bytes, ns.slot_bytes, a.queue_depth, batch)
            else:
                runs["radixtier"].append(ns.read_once())
                if part == "reads":
                    runs["radixtier_4k"].append(ns.read_once(huge=False))
                f = fio_once(ns.path, ns.data_offset, n * ns.slot_bytes, ns.slot_bytes, a.queue_depth)
                raw = ns.raw_once()
                if raw is not None:
                    runs["raw"].append(raw)
                    if part == "reads":
                        runs["raw_fio_buffers"].append(ns.raw_once(like_fio=True))
                if hic is not None:
                    runs["hicachefile"].append(hic.read_once(drop_caches))
            if f is not None:
                runs["fio"].append(f)
        return _row(where, part, size, runs, {"pages": n, "batch_pages": batch, "queue_depth": a.queue_depth,
                                              "radixtier_info": ns.info()})
    finally:
        ns.close()
        if hic is not None:
            hic.close()
        if os.path.exists(fio_file):
            os.remove(fio_file)


TARGETS = {"reads": TARGET_READ_VS_FIO, "layer_first": TARGET_READ_VS_FIO, "writes": TARGET_WRITE_VS_FIO,
           "readers": TARGET_READERS_VS_FIO}


def _ratio(x: float, digits: int) -> str:
    """A ratio cell; '-' where the reference was not measured (NaN)."""
    return "-" if x != x else f"{x:.{digits}f}x"


def report(a: argparse.Namespace, rows: List[Dict[str, object]]) -> None:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"targets_vs_fio": TARGETS, "reps": a.reps, "queue_depth": a.queue_depth, "rows": rows}, f, indent=2)
    nan = float("nan")
    lines = [f"GB/s, medians of {a.reps} interleaved rounds (min-max); ratios are medians of per-round ratios.", "",
             "radixtier reads into a host pool on transparent huge pages (radixtier.hostmem, as the embedded host "
             "pool); 4 KiB pages: the same reads into the allocator's 4 KiB-page memory, one allocation per page. "
             "Both are registered as io_uring fixed buffers (READ_FIXED for segments >= 256 KiB), as the embedded "
             "and SGLang host pools are.",
             "raw: unverified io_uring (plain readv) reads of the same slots into radixtier's buffers; "
             "raw into fio's buffers: "
             "the same into queue-depth page buffers used round robin (cache-hot, as fio's are).", "",
             "| where | what | page | radixtier | fio | radixtier, 4 KiB pages | raw (same buffers) "
             "| raw (fio's buffers) | HiCacheFile | vs fio | 4 KiB pages vs fio | vs raw | raw (fio's buffers) vs fio "
             "| vs HiCacheFile | target vs fio |",
             "|---|---|---:|---|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g, rg = r["gbps"], r["runs_gbps"]
        cell = {k: (f"{g[k]:.2f} ({min(rg[k]):.2f}-{max(rg[k]):.2f})" if rg.get(k) else "-") for k in rg}
        target = TARGETS[r["part"]]
        vf = r.get("vs_fio", nan)
        what = r["part"] + (f" x{r['procs']}" if r["part"] == "readers" else "")
        lines.append(f"| {r['where']} | {what} | {r['page_bytes'] >> 10} KiB | {cell['radixtier']} | {cell['fio']} | "
                     f"{cell.get('radixtier_4k', '-')} | {cell.get('raw', '-')} | {cell.get('raw_fio_buffers', '-')} | {cell.get('hicachefile', '-')} | "
                     f"{_ratio(vf, 2)} | {_ratio(r.get('radixtier_4k_vs_fio', nan), 2)} | "
                     f"{_ratio(r.get('vs_raw', nan), 2)} | "
                     f"{_ratio(r.get('raw_fio_buffers_vs_fio', nan), 2)} | {_ratio(r.get('vs_hicachefile', nan), 1)} | "
                     f"{target}x: {'met' if vf >= target else 'not met'} |")
    table = "\n".join(lines)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(table + "\n")
    print(table)
    png = os.path.splitext(a.out)[0] + ".png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {a.out}, {md} (matplotlib missing: no plot)")
        return
    places = sorted({r["where"] for r in rows})
    fig, axes = plt.subplots(1, len(places), figsize=(6.5 * len(places), 4.5), squeeze=False)
    for ax, where in zip(axes[0], places):
        reads = [r for r in rows if r["where"] == where and r["part"] == "reads"]
        xs = [r["page_bytes"] >> 10 for r in reads]
        for name, style in (("radixtier", "o-"), ("radixtier_4k", "o:"), ("fio", "s--"), ("raw", "^:"), ("raw_fio_buffers", "v:"),
                            ("hicachefile", "x-.")):
            pts = [(x, r) for x, r in zip(xs, reads) if r["runs_gbps"].get(name)]
            if not pts:
                continue
            med = [r["gbps"][name] for _, r in pts]
            lo = [m - min(r["runs_gbps"][name]) for m, (_, r) in zip(med, pts)]
            hi = [max(r["runs_gbps"][name]) - m for m, (_, r) in zip(med, pts)]
            ax.errorbar([x for x, _ in pts], med, yerr=[lo, hi], fmt=style, capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (KiB)")
        ax.set_ylabel("GB/s (cold read, verified)")
        ax.set_title(f"tier-3 reads on {where} (bars: min-max of {a.reps} rounds)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {a.out}, {md}, {png}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--dir", default=None, help="where the disk's bench files go (default: a temp dir on /var/tmp)")
    ap.add_argument("--ram-device", action="store_true",
                    help="also run on a RAM-backed loop device made for this run (stable figures; needs root)")
    ap.add_argument("--no-disk", action="store_true", help="with --ram-device: skip the disk")
    ap.add_argument("--sizes", default="64KiB,256KiB,1MiB,4MiB,8MiB", help="page sizes for reads and writes")
    ap.add_argument("--parts", default="reads,layer_first,writes,readers", help="which measurements to run")
    ap.add_argument("--total", type=parse_bytes, default=parse_bytes("512MiB"), help="bytes moved per measurement")
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    ap.add_argument("--batch-bytes", type=parse_bytes, default=parse_bytes("256MiB"),
                    help="bytes per get()/put() call (a prefetch or backup of a long prefix)")
    ap.add_argument("--procs", type=int, default=8, help="processes for the many-readers part (a TP8 node)")
    ap.add_argument("--readers-page", default="256KiB", help="page size for the many-readers part")
    ap.add_argument("--readers-total", type=parse_bytes, default=parse_bytes("2GiB"),
                    help="bytes the many-readers part moves in all (enough that process start skew is noise)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hicache-total", type=parse_bytes, default=parse_bytes("128MiB"),
                    help="bytes HiCacheFile reads (it is slow; its GB/s does not depend on the amount)")
    ap.add_argument("--no-hicachefile", action="store_true")
    ap.add_argument("--out", default="bench/results/l3_bandwidth.json", help="JSON; .md and .png go beside it")
    a = ap.parse_args(argv)
    rows: List[Dict[str, object]] = []
    if a.ram_device:
        from ramdevice import RamDeviceUnavailable, ram_device

        need = 3 * a.total + a.hicache_total + 2 * a.readers_total + (1 << 30)
        try:
            with ram_device(need) as mount:
                rows += run_place(a, "ram-device", mount)
        except RamDeviceUnavailable as exc:
            print(f"RAM device skipped: {exc}", file=sys.stderr)
    if not (a.ram_device and a.no_disk):
        rows += run_place(a, "disk", a.dir)
    report(a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
