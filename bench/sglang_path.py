"""L3 backup and prefetch through SGLang 0.5.23's own cache code, side by side in one run.

Each backend is driven the way SGLang's scheduler drives it (radixtier/testing/sglang_driver.py): requests
are inserted and written through (L1 -> L2 -> L3 by the controller's backup thread), every copy
is evicted from L1 and L2, and the scheduler's prefetch brings them back into L2 through the
controller's prefetch threads. Times are SGLang's own path end to end:

  backup    insert of the request -> the controller's L3 ack (includes SGLang's L1->L2 copy)
  prefetch  prefetch_from_storage -> check_prefetch_progress says done (L3 -> L2)

The driver steps the cache (check_hicache_events) every 1 ms, as a scheduler loop with nothing
else to run does; a busy scheduler steps once per forward pass, which adds the same latency to
every backend.

Backends: radixtier (fdatasync before a page is indexed, as shipped; and with sync off, as
HiCacheFile never syncs), SGLang's `file` backend (HiCacheFile: one buffered file per page),
SGLang's `nixl` backend with NIXL's POSIX plugin when the nixl packages are installed, and fio
reading the same block size at queue depth 16 (the device's limit; at least 256 MiB, so fio's
whole-ms timer does not quantize it). `floor` is a backend that moves no bytes
(null_storage.py): SGLang's own machinery for the same request, so radixtier's time above it is
what its I/O costs ("radixtier I/O" = bytes / that time). Cold = the page cache dropped (or
fadvise'd away) before the prefetch; warm = not. Each cell starts with one untimed run per
backend (a process's first runs of a shape pay one-off costs, billed otherwise to whichever
backend goes first); rounds then interleave the backends; medians and spread are reported.
Python's GC is collected and frozen after setup. torch runs one intra-op thread, as in SGLang's
scheduler on a GPU.

    python bench/sglang_path.py [--ram-device | --dir DIR] [--shape llama8b,small]
                                [--layouts layer_first,page_first_direct] [--reps 2] [--turns 6]
                                [--json out.json] [--md out.md] [--png out.png]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))

from l3_bandwidth import drop_caches, fio_once  # noqa: E402

SHAPES = {  # name: (layers, kv heads, head dim, page tokens, pages per run)
    "llama8b": (32, 8, 128, 64, 24),  # 8 MiB pages (Llama-3-8B, bf16, page 64)
    "small": (4, 2, 64, 16, 384),  # 32 KiB pages
}


def page_bytes_of(shape: str) -> int:
    layers, heads, dim, ps, _pages = SHAPES[shape]
    return 2 * layers * heads * dim * ps * 2  # K and V, bf16


def open_node(backend: str, layout: str, shape: str, store_dir: str, pages: int):
    """A fresh SGLang cache of `shape` with room for `pages` pages in L1, `backend` as its L3."""
    from radixtier.testing.sglang_driver import SGLangNode

    layers, heads, dim, ps, _pages = SHAPES[shape]
    shutil.rmtree(store_dir, ignore_errors=True)
    os.makedirs(store_dir)
    kind, extra, env = _backend_config(backend, store_dir, page_bytes_of(shape), pages)
    return SGLangNode(extra, layout=layout, page_size=ps, layers=layers, heads=heads, head_dim=dim,
                      device_tokens=(pages + 2) * ps, host_ratio=2.0, storage_backend=kind, storage_env=env)


def run_one(backend: str, layout: str, shape: str, workdir: str, cold: bool) -> Dict[str, float]:
    _l, _h, _d, ps, pages = SHAPES[shape]
    page_bytes = page_bytes_of(shape)
    store_dir = os.path.join(workdir, f"{backend}-{layout}-{shape}")
    node = open_node(backend, layout, shape, store_dir, pages)
    try:
        tokens = list(range(7, 7 + pages * ps))
        gc.collect()
        gc.freeze()  # a full GC over this heap can pause SGLang's I/O threads for 0.1-0.7 s
        cached, slots, _kv = node.prefill(tokens, seed=3)  # KV generation is not the backend's time
        t0 = time.perf_counter()
        node.cache_request(tokens, cached, slots)
        node.settle_backups()
        backup_s = time.perf_counter() - t0
        node.evict_all()
        m = node.match(tokens)
        assert m.device_prefix_len == 0 and m.host_hit_length == 0, f"{backend}: pages still in L1/L2"
        if cold:
            drop_caches([os.path.join(r, f) for r, _d, fs in os.walk(store_dir) for f in fs])
        t0 = time.perf_counter()
        loaded = node.prefetch(tokens)
        prefetch_s = time.perf_counter() - t0
        assert loaded == len(tokens), f"{backend}: prefetch loaded {loaded} of {len(tokens)} tokens"
        nbytes = pages * page_bytes
        return {"backup_GBps": nbytes / backup_s / 1e9, "prefetch_GBps": nbytes / prefetch_s / 1e9,
                "backup_s": backup_s, "prefetch_s": prefetch_s,
                "prefetch_pages_per_s": pages / prefetch_s, "backup_pages_per_s": pages / backup_s,
                "page_bytes": page_bytes, "pages": pages}
    finally:
        gc.unfreeze()
        node.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def multi_turn(backend: str, layout: str, shape: str, workdir: str, turns: int = 6) -> List[float]:
    """Storage share of TTFT, per turn of one conversation: request arrival (prefetch) -> its whole
    prefix on the device. Between turns other traffic pushes the conversation out of L1 and L2
    (evict_all), so every turn's prefix comes back from L3; each turn adds a quarter of the pages."""
    _l, _h, _d, ps, pages = SHAPES[shape]
    step = max(1, pages // 4)
    store_dir = os.path.join(workdir, f"mt-{backend}-{layout}-{shape}")
    node = open_node(backend, layout, shape, store_dir, step * (turns + 1))
    shares: List[float] = []
    try:
        tokens: List[int] = []
        for turn in range(turns):
            tokens = tokens + list(range(10_000_000 * (turn + 1), 10_000_000 * (turn + 1) + step * ps))
            if turn:
                node.evict_all()
                drop_caches([os.path.join(r, f) for r, _d, fs in os.walk(store_dir) for f in fs])
                t0 = time.perf_counter()
                node.prefetch(tokens)
                node.load_to_device(tokens)
                shares.append(time.perf_counter() - t0)
            node.insert(tokens, seed=turn)
            node.settle_backups()
    finally:
        node.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return shares


def _backend_config(backend: str, store_dir: str, page_bytes: int, pages: int):
    env: Dict[str, str] = {}
    if backend.startswith("radixtier"):
        slots = max(pages + 16, 64)  # a namespace holds whole blocks of 64 slot-table entries
        extra = {"path": os.path.join(store_dir, "ns.img"), "capacity": str(slots * (page_bytes + 8192) + (64 << 20)),
                 "node_id": "bench", "partitions": 1, "sync": backend == "radixtier"}
        return "dynamic", extra, env
    if backend == "floor":
        return "dynamic", {"backend_name": "floor", "module_path": "null_storage", "class_name": "NullStorage"}, env
    if backend == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = store_dir
        return "file", {}, env
    env["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = store_dir
    return "nixl", {"plugin": {"posix": {"active": True, "use_uring": "true"}}, "use_direct_io": True,
                    "l3_cleaner_enabled": False}, env


FIO_MIN_BYTES = 256 << 20  # fio times in whole ms: 12 MiB (4 ms) would be quantized by +-25%


def fio_reference(workdir: str, shape: str) -> Optional[float]:
    """fio direct sequential read, block = one page, queue depth 16 (GB/s): the device's rate for
    this block size, over the run's bytes or FIO_MIN_BYTES, whichever is more."""
    pages, page_bytes = SHAPES[shape][4], page_bytes_of(shape)
    nbytes = max(pages * page_bytes, FIO_MIN_BYTES // page_bytes * page_bytes)
    path = os.path.join(workdir, "fio.img")
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(nbytes // len(chunk) + 1):
            f.write(chunk)
    os.sync()
    bw = fio_once(path, 0, nbytes, page_bytes, 16)
    os.remove(path)
    return None if bw is None else bw / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the stores live (default: a temp dir on /tmp's filesystem)")
    ap.add_argument("--shape", default="llama8b,small", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--layouts", default="layer_first,page_first_direct")
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds per cell")
    ap.add_argument("--warm", action="store_true", help="also run warm (page cache kept) prefetches")
    ap.add_argument("--turns", type=int, default=6, help="turns of the multi-turn TTFT-share run (0: skip it)")
    ap.add_argument("--ram-device", action="store_true",
                    help="put the stores on a RAM-backed loop device made (and removed) for this run (needs root)")
    ap.add_argument("--json", default="bench/results/sglang_path.json")
    ap.add_argument("--md", default="bench/results/sglang_path.md")
    ap.add_argument("--png", default="bench/results/sglang_path.png")
    a = ap.parse_args(argv)
    if a.ram_device:
        from ramdevice import RamDeviceUnavailable, ram_device

        try:
            with ram_device(3 << 30) as mount:
                return run_all(a, os.path.join(mount, "work"))
        except RamDeviceUnavailable as exc:
            print(f"RAM device skipped ({exc}); using {a.dir or 'a temp dir'}", file=sys.stderr)
    return run_all(a, a.dir or tempfile.mkdtemp(prefix="sglang-path-"))


def run_all(a: argparse.Namespace, workdir: str) -> int:
    logging.getLogger("sglang").setLevel(logging.ERROR)
    import torch

    # One intra-op thread, as SGLang's scheduler process (where the HiCache controller and its
    # backend run) sets for a GPU model (ModelRunner.load_model). With torch's default, an OpenMP
    # worker woken by the shim's host-pool copies spun on one of this VM's two CPUs the whole run,
    # taking it from every backend's I/O (seen in perf as libgomp at ~47% of all samples).
    torch.set_num_threads(1)
    backends = ["radixtier", "radixtier-nosync", "file"]
    if importlib.util.find_spec("nixl") is not None:
        backends.append("nixl")
    backends.append("floor")  # last: the ratios below name the real backends by position
    os.makedirs(workdir, exist_ok=True)
    temps = [False, True] if a.warm else [False]
    rows: List[Dict[str, object]] = []
    from tqdm import tqdm

    cells = [(s, lay, warm) for s in a.shape.split(",") for lay in a.layouts.split(",") for warm in temps]
    bar = tqdm(total=len(cells) * (a.reps + 1) * (len(backends) + 1), desc="sglang path", unit="run")
    for shape, layout, warm in cells:
        runs: Dict[str, List[Dict[str, float]]] = {b: [] for b in backends}
        fio: List[float] = []
        for b in backends:  # untimed: imports, SGLang's JIT hash build, first use of this shape's memory
            run_one(b, layout, shape, workdir, cold=not warm)
            bar.update()
        bar.update()
        for r in range(a.reps):
            order = backends if r % 2 == 0 else list(reversed(backends))
            for b in order:
                runs[b].append(run_one(b, layout, shape, workdir, cold=not warm))
                bar.update()
            f = fio_reference(workdir, shape)
            if f is not None:
                fio.append(f)
            bar.update()
        row: Dict[str, object] = {"shape": shape, "layout": layout, "cache": "warm" if warm else "cold",
                                  "page_bytes": runs[backends[0]][0]["page_bytes"],
                                  "fio_GBps": statistics.median(fio) if fio else None, "fio_runs": fio}
        for b in backends:
            for metric in ("prefetch_GBps", "backup_GBps"):
                vals = [x[metric] for x in runs[b]]
                row[f"{b}_{metric}"] = statistics.median(vals)
                row[f"{b}_{metric}_runs"] = vals
        for other in backends[2:-1]:
            for metric in ("prefetch_GBps", "backup_GBps"):
                row[f"radixtier_vs_{other}_{metric}"] = row[f"radixtier_{metric}"] / row[f"{other}_{metric}"]
        nbytes = runs["radixtier"][0]["pages"] * runs["radixtier"][0]["page_bytes"]
        for metric in ("prefetch", "backup"):
            rt = statistics.median(x[f"{metric}_s"] for x in runs["radixtier"])
            floor = statistics.median(x[f"{metric}_s"] for x in runs["floor"])
            row[f"floor_{metric}_ms"], row[f"radixtier_{metric}_ms"] = floor * 1e3, rt * 1e3
            row[f"radixtier_io_{metric}_GBps"] = nbytes / (rt - floor) / 1e9 if rt > floor else None
            row[f"floor_bound_{metric}_GBps"] = nbytes / floor / 1e9  # no backend through SGLang beats this
        if fio:
            row["radixtier_prefetch_vs_fio"] = row["radixtier_prefetch_GBps"] / row["fio_GBps"]
            if row["radixtier_io_prefetch_GBps"]:
                row["radixtier_io_prefetch_vs_fio"] = row["radixtier_io_prefetch_GBps"] / row["fio_GBps"]
            row["floor_bound_prefetch_vs_fio"] = row["floor_bound_prefetch_GBps"] / row["fio_GBps"]
        rows.append(row)
    bar.close()
    ttft: List[Dict[str, object]] = []
    if a.turns > 1:
        for shape in a.shape.split(","):
            for layout in a.layouts.split(","):
                row = {"shape": shape, "layout": layout}
                for b in backends:
                    shares = multi_turn(b, layout, shape, workdir, a.turns)
                    row[f"{b}_ms"] = statistics.median(shares) * 1e3
                    row[f"{b}_ms_runs"] = [x * 1e3 for x in shares]
                ttft.append(row)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"backends": backends, "rows": rows, "ttft_storage_share": ttft, "workdir": workdir}, f, indent=2)
    real = backends[:-1]  # without the floor
    others = real[2:]
    lines = ["| shape | layout | cache | " + " | ".join(f"{b} prefetch / backup GB/s" for b in real)
             + " | fio GB/s | radixtier prefetch vs fio | "
             + " | ".join(f"vs {o} (prefetch / backup)" for o in others) + " |",
             "|" + "---|" * (5 + len(real) + len(others))]
    for r in rows:
        cells_txt = " | ".join(f"{r[f'{b}_prefetch_GBps']:.2f} / {r[f'{b}_backup_GBps']:.2f}" for b in real)
        fio_txt = f"{r['fio_GBps']:.2f}" if r["fio_GBps"] else "-"
        vs = f"{r['radixtier_prefetch_vs_fio']:.2f}x" if r.get("radixtier_prefetch_vs_fio") else "-"
        vo = " | ".join(f"{r[f'radixtier_vs_{o}_prefetch_GBps']:.2f}x / {r[f'radixtier_vs_{o}_backup_GBps']:.2f}x"
                        for o in others)
        lines.append(f"| {r['shape']} | {r['layout']} | {r['cache']} | {cells_txt} | {fio_txt} | {vs} | {vo} |")
    lines += ["", "SGLang's own share (floor: a backend that moves no bytes) and radixtier's I/O above it, medians. "
              "Floor bound = bytes / floor time: the most any backend can reach through SGLang, even one whose "
              "I/O took no time.", "",
              "| shape | layout | cache | floor prefetch ms | floor bound GB/s | bound vs fio | radixtier prefetch ms "
              "| radixtier I/O GB/s | I/O vs fio | floor backup ms | radixtier backup ms |", "|" + "---|" * 11]
    for r in rows:
        io = r["radixtier_io_prefetch_GBps"]
        io_vs = r.get("radixtier_io_prefetch_vs_fio")
        bound_vs = r.get("floor_bound_prefetch_vs_fio")
        lines.append(f"| {r['shape']} | {r['layout']} | {r['cache']} | {r['floor_prefetch_ms']:.1f} | "
                     f"{r['floor_bound_prefetch_GBps']:.2f} | {f'{bound_vs:.2f}x' if bound_vs else '-'} | "
                     f"{r['radixtier_prefetch_ms']:.1f} | {f'{io:.2f}' if io else '-'} | "
                     f"{f'{io_vs:.2f}x' if io_vs else '-'} | {r['floor_backup_ms']:.1f} | {r['radixtier_backup_ms']:.1f} |")
    if ttft:
        lines += ["", "Storage share of TTFT per turn (request arrival -> prefix on device, median ms over turns):", "",
                  "| shape | layout | " + " | ".join(backends) + " |", "|" + "---|" * (2 + len(backends))]
        for r in ttft:
            lines.append(f"| {r['shape']} | {r['layout']} | " + " | ".join(f"{r[f'{b}_ms']:.0f}" for b in backends)
                         + " |")
    table = "\n".join(lines)
    with open(a.md, "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        labels = [f"{r['shape']}\n{r['layout']}\n{r['cache']}" for r in rows]
        for ax, metric in zip(axes, ("prefetch_GBps", "backup_GBps")):
            width = 0.8 / (len(real) + 1)
            for i, b in enumerate(real):
                ax.bar([x + i * width for x in range(len(rows))], [r[f"{b}_{metric}"] for r in rows], width, label=b)
            if metric == "prefetch_GBps":
                ax.bar([x + len(real) * width for x in range(len(rows))], [r["fio_GBps"] or 0 for r in rows],
                       width, label="fio (limit)", color="gray")
            ax.set_xticks([x + 0.4 for x in range(len(rows))], labels, fontsize=7)
            ax.set_ylabel("GB/s")
            ax.set_title(f"through SGLang's controller: {metric.split('_')[0]}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        print(f"wrote {a.json}, {a.md}, {a.png}")
    except ImportError:
        print(f"wrote {a.json}, {a.md} (matplotlib missing: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
