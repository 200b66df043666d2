"""Before/after: one bench, two code versions, side by side in one run (interleaved rounds).

Each round runs the bench once under each version, in a fresh process, the order alternating
(round 1: before, after; round 2: after, before; ...), so drift in the machine (page cache, CPU
clocks, a neighbour VM) falls on both alike. A version is a directory holding a `radixtier`
package with storage/ and integrations/ inside it (and its native .so files), put first on the
subprocess's PYTHONPATH; the current tree (the editable install) runs with no PYTHONPATH. The
bench script is always this tree's bench/<script>, so both versions run the same measurement code.

  l3    bench/l3_bandwidth.py   GB/s of NvmeofPageStore reads, layer_first reads and writes, with
                                fio and raw io_uring reads measured in the same run
  tree  bench/tree_ops.py       time of match / insert / evict in TieredKVCache, with SGLang's
                                RadixCache measured in the same run

Every figure the bench reports is collected; the table gives, per figure, the median over rounds
for each version, the speed ratio of the medians and the range of the per-round ratios. Speed
ratio > 1 always means the after version is faster: for GB/s and for ratios against references
(radixtier/fio, sglang/radixtier) it is after/before, for times it is before/after. Figures from
code that is the same in both versions (fio, SGLang, HiCacheFile) are listed as references: how
far their per-round ratios stray from 1 is this machine's noise (tree_ops runs SGLang in the same
process as radixtier, so a version's heap and cache footprint can move them too). One of
radixtier's own figures is flagged slower (faster) when its ratio is beyond --tolerance and beyond
that noise (90th percentile, either way, of the per-round ratios of the references timed in the
same measurement: same operation or page size), and every round is on the same side of 1 (3 rounds
or more). For the noise alone, compare a version with a copy of itself (an A/A run: --after a second copy of
the --before dir).

examples:
    python bench/compare_versions.py l3 --before /tmp/rt/before
    python bench/compare_versions.py tree --before /tmp/rt/before --rounds 3
    python bench/compare_versions.py l3 --before /tmp/rt/head --before-rev HEAD
    python bench/compare_versions.py tree --before /tmp/rt/before --after /tmp/rt/before-copy   # A/A
    python bench/compare_versions.py l3 --before /tmp/rt/before -- --sizes 64KiB --parts reads
    python bench/compare_versions.py l3 --before /tmp/rt/before --replace-defaults \
        -- --ram-device --no-disk --parts reads --reps 5

Bench arguments: anything this script does not know (or everything after `--`) goes to the bench,
after the defaults below, so a valued option given again wins (--sizes, --reps, ...). Flags in the
defaults (--ram-device, --no-disk, ...) cannot be undone that way: use --replace-defaults to pass
only your own. --out is this script's (each run writes into a temp dir).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VERSIONS = ("before", "after")

BENCHES: Dict[str, Dict[str, object]] = {
    "l3": {
        "script": "l3_bandwidth.py",
        # ~50 s a run on a 2-CPU VM: 5 rounds x 2 versions in ~9 min. 64 KiB is the size where
        # Python per page costs most (the refactor's overheads show there first); layer_first
        # times the scattered-segment path; the RAM device keeps the disk's 2x swings out.
        "defaults": ["--ram-device", "--no-disk", "--no-hicachefile", "--reps", "3", "--total", "256MiB",
                     "--sizes", "64KiB,256KiB,4MiB", "--parts", "reads,layer_first,writes",
                     "--readers-total", "64MiB", "--hicache-total", "16MiB"],
        "modules": ["radixtier.cli", "radixtier.hostmem", "radixtier.storage.api",
                    "radixtier.storage.nvmeof.io_engine", "radixtier.storage.nvmeof.layout",
                    "radixtier.storage.nvmeof.store"],
    },
    "tree": {
        "script": "tree_ops.py",
        # the bench's own sizes (1M cached tokens, sweep to 8M); more repetitions than its
        # defaults, as each timed operation is well under a millisecond (~22 s a run)
        "defaults": ["--repeats", "100", "--scale-repeats", "20"],
        "modules": ["radixtier.cache", "radixtier.hashing", "radixtier.tiers"],
    },
}
# native extensions: a version without one runs its pure-Python stand-in (not a fair comparison)
NATIVE = ("radixtier._slotpool", "radixtier.storage.nvmeof._fence", "radixtier.storage.nvmeof._uring")
L3_REFERENCES = {"fio", "hicachefile"}  # figures of code that is not radixtier's
STAGE_MARKER = ".compare_versions.json"
FLAG_MIN_ROUNDS = 3  # with 2, two rounds on one side of 1 by chance is too likely (1 in 2 under pure noise)


class Refused(RuntimeError):
    """A one-line reason the comparison cannot run (printed without a traceback)."""


# ---------------------------------------------------------------------------------------------
# pure part: figures out of one bench result, and the before/after table (no processes, no I/O)

def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _kib(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10}KiB"


def _tokens(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def _metric(value: float, unit: str, better: str, group: str, level: str = "main",
            cls: str = "all") -> Dict[str, object]:
    """better: 'higher' (rates, ratios), 'lower' (times) or 'delta' (a slope: compared by difference).
    group: 'radixtier' (the code compared), 'relative' (radixtier against a reference measured in the
    same run) or 'reference' (code the same in both versions). level: 'main' or 'detail'. cls: the
    measurement it belongs to (one operation or page size, the same statistic, timed in the same
    runs): a figure's noise is what the references of its class did between the same runs."""
    return {"value": float(value), "unit": unit, "better": better, "group": group, "level": level, "cls": cls}


def _flatten(prefix: str, v: object, out: Dict[str, object]) -> None:
    if isinstance(v, dict):
        for k, x in v.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), x, out)
    else:
        out[prefix] = v


def collect_l3(res: dict) -> Tuple[Dict[str, dict], Dict[str, object]]:
    """bench/l3_bandwidth.py's JSON -> ({figure: metric}, {setting: value})."""
    metrics: Dict[str, dict] = {}
    settings: Dict[str, object] = {k: v for k, v in res.items() if k != "rows"}
    for row in res.get("rows", []):
        part = row.get("part", "?")
        what = part + (f" x{row['procs']}" if part == "readers" and "procs" in row else "")
        base = f"{row.get('where', '?')} {what} {_kib(int(row.get('page_bytes', 0)))}"
        for k, v in row.get("gbps", {}).items():
            if _num(v):
                group = "reference" if k in L3_REFERENCES else "radixtier"
                metrics[f"{base} {k}"] = _metric(v, "GB/s", "higher", group, cls=base)
        for k, v in row.items():
            if k in ("gbps", "runs_gbps", "where", "part", "page_bytes"):
                continue
            if _num(v) and (k.startswith("vs_") or "_vs_" in k):  # vs_fio = radixtier / fio, per round
                name = "radixtier/" + k[3:] if k.startswith("vs_") else k.replace("_vs_", "/")
                metrics[f"{base} {name}"] = _metric(v, "x", "higher", "relative", cls=base)
            else:  # pages, batch_pages, queue_depth, radixtier_info (io_engine, direct_io, corrupt), ...
                _flatten(f"{base} {k}", v, settings)
    return metrics, settings


def collect_tree(res: dict) -> Tuple[Dict[str, dict], Dict[str, object]]:
    """bench/tree_ops.py's JSON -> ({figure: metric}, {setting: value}); times in µs."""
    metrics: Dict[str, dict] = {}
    settings: Dict[str, object] = {}
    for k, v in res.items():
        if k not in ("ops", "scale"):
            _flatten(k, v, settings)  # cached_tokens, repeats, ..., matched_prefix_tokens (the work done)

    def time_metric(stat: str, v: float, engine: str, main: bool, cls: str) -> Dict[str, object]:
        unit, scale = ("µs", 1e3) if stat.endswith("_ms") else ("s", 1.0) if stat.endswith("_s") else ("", 1.0)
        return _metric(v * scale, unit, "lower", "radixtier" if engine == "radixtier" else "reference",
                       "main" if main else "detail", cls)

    copies = set()  # (op, engine): tree_ops copies sglang-sim's match figures to sglang-paged (same code)
    for op, row in res.get("ops", {}).items():
        seen: List[dict] = []
        for engine, stats in row.items():
            if isinstance(stats, dict) and engine != "radixtier" and stats in seen:
                copies.add((op, engine))
                continue
            if isinstance(stats, dict):
                seen.append(stats)
                for stat, v in stats.items():
                    if _num(v):
                        p50 = stat.startswith("p50")
                        metrics[f"{op} {engine} {stat.rsplit('_', 1)[0]}"] = time_metric(
                            stat, v, engine, p50, op if p50 else f"{op} tails")
            elif _num(stats) and engine.endswith("_over_radixtier") \
                    and (op, engine[:-len("_over_radixtier")]) not in copies:  # SGLang time / radixtier time
                metrics[f"{op} {engine[:-len('_over_radixtier')]}/radixtier"] = _metric(
                    stats, "x", "higher", "relative", cls=op)
    scale = res.get("scale") or {}
    sizes = scale.get("cached_tokens", [])
    for op, engines in scale.get("p50_ms", {}).items():
        for engine, vals in engines.items():
            if (op, engine) in copies:
                continue
            for n, v in zip(sizes, vals):
                if _num(v):
                    metrics[f"sweep {_tokens(n)} cached: {op} {engine} p50"] = time_metric(
                        "p50_ms", v, engine, engine == "radixtier", f"sweep {_tokens(n)}: {op}")
    for op, engines in scale.get("slope", {}).items():
        for engine, v in engines.items():
            if _num(v) and (op, engine) not in copies:
                metrics[f"slope {op} {engine}"] = _metric(v, "", "delta",
                                                          "radixtier" if engine == "radixtier" else "reference",
                                                          "detail", f"slope {op}")
    return metrics, settings


COLLECTORS = {"l3": collect_l3, "tree": collect_tree}


def speed_ratio(before: float, after: float, better: str) -> float:
    """> 1: after is faster (after/before for rates and ratios, before/after for times); for
    'delta' figures the difference after - before."""
    if better == "delta":
        return after - before
    num, den = (after, before) if better == "higher" else (before, after)
    return num / den if den else float("nan")


def noise_factor(ratios: Sequence[float], quantile: float = 0.9) -> float:
    """How far the same code's per-round ratios stray from 1, either way: the `quantile` of
    max(r, 1/r) (robust to one outlier among a class's references; the max with few values)."""
    devs = sorted(max(r, 1 / r) for r in ratios)
    return devs[min(len(devs) - 1, int(round(quantile * (len(devs) - 1))))]


def compare(bench: str, runs: Sequence[dict], tolerance: float = 0.05) -> Dict[str, object]:
    """runs: [{'round': r, 'version': 'before'|'after', 'result': the bench's JSON}, ...] ->
    {'metrics': [row, ...], 'warnings': [...], 'noise': {class: {'span': (min, max) of its references'
    per-round ratios, 'factor': noise_factor of them}}, 'flag_bounds': {class: (lo, hi)}, 'tolerance': ...}.
    A row has the per-round values of
    each version, their medians, the speed ratio of the medians, the per-round ratios and their
    min-max, and a flag ('slower', 'faster' or '')."""
    collect = COLLECTORS[bench]
    per: Dict[Tuple[str, int], Dict[str, dict]] = {}
    settings: Dict[str, Dict[str, set]] = {}
    order: Dict[str, dict] = {}
    for run in runs:
        metrics, sets = collect(run["result"])
        per[(run["version"], run["round"])] = metrics
        for name, m in metrics.items():
            order.setdefault(name, m)
        for k, v in sets.items():
            settings.setdefault(k, {ver: set() for ver in VERSIONS})[run["version"]].add(json.dumps(v, sort_keys=True))
    rounds = sorted({run["round"] for run in runs})
    warnings: List[str] = []
    for k, by in settings.items():
        if by["before"] and by["after"] and by["before"] != by["after"]:
            warnings.append(f"{k} differs: before {', '.join(sorted(by['before']))}; "
                            f"after {', '.join(sorted(by['after']))} (the versions did not do the same work?)")
    rows: List[Dict[str, object]] = []
    for name, meta in order.items():
        vals = {ver: [per.get((ver, r), {}).get(name, {}).get("value") for r in rounds] for ver in VERSIONS}
        row: Dict[str, object] = {"metric": name, **{k: meta[k] for k in ("unit", "better", "group", "level", "cls")},
                                  "rounds": rounds, "before": vals["before"], "after": vals["after"]}
        b = [x for x in vals["before"] if x is not None]
        a = [x for x in vals["after"] if x is not None]
        row["before_median"] = statistics.median(b) if b else None
        row["after_median"] = statistics.median(a) if a else None
        per_round = [speed_ratio(x, y, meta["better"]) for x, y in zip(vals["before"], vals["after"])
                     if x is not None and y is not None]
        per_round = [r for r in per_round if not math.isnan(r)]
        row["round_ratios"] = per_round
        if b and a:
            row["ratio"] = speed_ratio(row["before_median"], row["after_median"], meta["better"])
        else:
            row["ratio"] = None
            warnings.append(f"{name}: measured only in {'after' if a else 'before'}")
        row["ratio_min"], row["ratio_max"] = (min(per_round), max(per_round)) if per_round else (None, None)
        row["flag"] = ""
        rows.append(row)
    refs: Dict[str, List[float]] = {}
    for r in rows:
        if r["group"] == "reference" and r["better"] != "delta":
            refs.setdefault(r["cls"], []).extend(x for x in r["round_ratios"] if x > 0)
    noise = {c: {"span": (min(v), max(v)), "factor": noise_factor(v)} for c, v in refs.items() if v}
    # flagged (radixtier's own figures): the median ratio beyond the tolerance and beyond the noise
    # of the references measured alike, and every round on the same side of 1. Ratios against a
    # reference are shown, not flagged: one outlier in the reference swings them as far.
    bounds = {}
    for c in {r["cls"] for r in rows}:
        factor = max(1 + tolerance, 1 / (1 - tolerance), noise[c]["factor"] if c in noise else 1.0)
        bounds[c] = (1 / factor, factor)
    for row in rows:
        if row["group"] != "radixtier" or row["better"] == "delta" or row.get("ratio") is None \
                or len(row["round_ratios"]) < FLAG_MIN_ROUNDS:
            continue
        lo, hi = bounds[row["cls"]]
        if row["ratio"] < lo and row["ratio_max"] < 1:
            row["flag"] = "slower"
        elif row["ratio"] > hi and row["ratio_min"] > 1:
            row["flag"] = "faster"
    return {"metrics": rows, "warnings": warnings, "noise": noise, "tolerance": tolerance, "flag_bounds": bounds}


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "":
        return f"{v:+.2f}"
    if unit in ("µs", "s") and abs(v) < 10:
        return f"{v:.2f}"
    return f"{v:.1f}" if unit in ("µs", "s") else f"{v:.2f}"


def _fmt_ratio(v: Optional[float], better: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"Δ{v:+.2f}" if better == "delta" else f"{v:.2f}"


GROUP_TITLES = {
    "radixtier": "radixtier (the code that differs between the versions)",
    "relative": "radixtier against a reference measured in the same run (ratio of ratios: noise common to both "
                "cancels)",
    "reference": "references: code that is the same in both versions (how far these stray from 1.00 is noise)",
}


def format_table(cmp: Dict[str, object], levels: Sequence[str] = ("main",)) -> str:
    """The Markdown table of compare()'s rows at `levels`, one section per group."""
    lines = ["| metric | unit | before | after | speed ratio | per-round range | noise | flag |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for group, title in GROUP_TITLES.items():
        rows = [r for r in cmp["metrics"] if r["group"] == group and r["level"] in levels]
        if not rows:
            continue
        lines.append(f"| **{title}** | | | | | | | |")
        for r in rows:
            rng = "-" if r["ratio_min"] is None else \
                f"{_fmt_ratio(r['ratio_min'], r['better'])}–{_fmt_ratio(r['ratio_max'], r['better'])}"
            noise = cmp["noise"].get(r["cls"])
            noise_cell = "-" if noise is None or r["better"] == "delta" else \
                f"±{noise['factor'] - 1:.0%}" if noise["factor"] < 2 else f"×{noise['factor']:.0f}"
            lines.append(f"| {r['metric']} | {r['unit']} | {_fmt(r['before_median'], r['unit'])} | "
                         f"{_fmt(r['after_median'], r['unit'])} | {_fmt_ratio(r['ratio'], r['better'])} | {rng} | "
                         f"{noise_cell} | {r['flag']} |")
    return "\n".join(lines)


def summary_lines(cmp: Dict[str, object]) -> List[str]:
    """Noise (each class's references' per-round ratio range) and the flagged main figures, in words."""
    rows = cmp["metrics"]
    tol = cmp["tolerance"]
    out = []
    main_cls = {r["cls"] for r in rows if r["level"] == "main"}
    factors = sorted(n["factor"] - 1 for c, n in cmp["noise"].items() if c in main_cls)
    if factors:
        out.append(f"noise (the table's noise column: how far the references of the same measurement, the same code "
                   f"in both versions, strayed between the same runs): median ±{statistics.median(factors):.0%}, "
                   f"up to " + (f"±{factors[-1]:.0%}." if factors[-1] < 1 else f"×{factors[-1] + 1:.0f}."))
    if not any(len(r.get("round_ratios", [])) >= FLAG_MIN_ROUNDS for r in rows):
        return out + [f"no flags: they need {FLAG_MIN_ROUNDS} rounds or more (--rounds), so that rounds agreeing "
                      "is not chance."]
    for flag in ("slower", "faster"):
        main = [r for r in rows if r.get("flag") == flag and r["level"] == "main"]
        more = sum(1 for r in rows if r.get("flag") == flag and r["level"] != "main")
        if main or flag == "slower":
            names = [r["metric"] + (f" ({r['ratio']:.2f})") for r in main]
            out.append(f"{len(main)} main radixtier figure(s) flagged {flag} (ratio beyond ±{tol:.0%} and beyond "
                       f"the noise, every round {'< 1' if flag == 'slower' else '> 1'})"
                       + (": " + "; ".join(names) if names else "")
                       + (f" ({more} more among the detail figures)" if more else "") + ".")
    return out


def header_lines(bench: str, meta: Dict[str, object]) -> List[str]:
    v = meta["versions"]
    return [
        f"# bench/{BENCHES[bench]['script']}: before vs after, {meta['rounds']} interleaved rounds",
        "",
        f"- before: {v['before']['describe']}",
        f"- after: {v['after']['describe']}",
        f"- bench args: `{' '.join(meta['bench_args'])}`",
        f"- run order: {meta['order']}; wall time {meta['wall_s']:.0f} s",
        f"- the rest of the machine ({meta['cpus']} CPUs) during the runs, CPUs busy on average: "
        + "; ".join(f"{label} " + (", ".join(f"{x:.2f}" for x in meta["other_cpus"][label]) or "-")
                    for label in VERSIONS)
        + " (other processes, and kernel threads working for the bench)",
        "",
        "Speed ratio > 1 means the after version is faster: GB/s and x-ratios after/before, times "
        "(µs) before/after; slopes compared by difference (Δ). Before/after: medians over rounds of "
        "each run's figure (itself the bench's median of its own repetitions). Per-round range: min–max "
        f"of the rounds' ratios (round i: after_i vs before_i). Flag ({FLAG_MIN_ROUNDS}+ rounds; radixtier's own "
        "figures): the ratio beyond "
        f"±{meta['tolerance']:.0%} and beyond the noise, every round on the same side of 1. Noise: the 90th "
        "percentile, either way, of the per-round ratios of the references timed in the same measurement (same "
        "operation or page size, same runs): code that is the same in both versions.",
        "",
    ]


# ---------------------------------------------------------------------------------------------
# versions: staging a git revision, checking what each version imports

def _git(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, **kw)


def _so_files(base: str, subdirs: Sequence[str]) -> List[str]:
    """Native extension files under base/<subdir>, relative to base."""
    found = []
    for sub in subdirs:
        for root, dirs, files in os.walk(os.path.join(base, sub)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "build")]
            found += [os.path.relpath(os.path.join(root, f), base) for f in files if f.endswith(".so")]
    return sorted(found)


def _staged_path(rel: str) -> str:
    """A source-tree path (radixtier/x, storage/x, integrations/x) -> its place in a version dir."""
    return rel if rel.startswith("radixtier" + os.sep) else os.path.join("radixtier", rel)


def _extract(commit: str, paths: Sequence[str], dest: str) -> None:
    with tempfile.TemporaryFile() as tar:
        out = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", commit, *paths], stdout=tar,
                             stderr=subprocess.PIPE)
        if out.returncode:
            raise Refused(f"git archive {commit[:12]} failed: {out.stderr.decode().strip()}")
        tar.seek(0)
        with tarfile.open(fileobj=tar) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(dest, filter="data")
            else:
                tf.extractall(dest)


def stage_rev(rev: str, dest: str, python: str, log=print) -> Dict[str, object]:
    """Stage git revision `rev` of this repository as a version dir at `dest` (radixtier/ with
    storage/ and integrations/ inside it). Native .so files: copied from this tree when the C
    sources at `rev` are the tree's, else built from `rev` (setup.py build_ext --inplace in a
    scratch checkout). Reuses `dest` when it already holds a staging of the same commit."""
    out = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", text=True)
    if out.returncode:
        raise Refused(f"--before-rev {rev}: not a revision of {REPO}")
    commit = out.stdout.strip()
    marker = os.path.join(dest, STAGE_MARKER)
    if os.path.isdir(dest) and os.listdir(dest):
        if os.path.isfile(marker):
            with open(marker) as f:
                info = json.load(f)
            if info.get("commit") == commit:
                log(f"before: {dest} already holds {rev} ({commit[:12]}), native files {info.get('native')}")
                return info
        raise Refused(f"--before {dest} exists and is not a staging of {rev} ({commit[:12]}): "
                      "give a new or empty path with --before-rev")
    paths = [p for p in ("radixtier", "storage", "integrations")
             if _git("cat-file", "-e", f"{commit}:{p}").returncode == 0]
    if "radixtier" not in paths:
        raise Refused(f"--before-rev {rev}: no radixtier/ at {commit[:12]}")
    parent = os.path.dirname(os.path.abspath(dest)) or "."
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        src = os.path.join(work, "src")
        _extract(commit, paths, src)
        root = os.path.join(work, "root")
        os.makedirs(root)
        shutil.move(os.path.join(src, "radixtier"), os.path.join(root, "radixtier"))
        for p in paths[1:]:
            shutil.move(os.path.join(src, p), os.path.join(root, "radixtier", p))
        c_same = _git("diff", "--quiet", commit, "--", *[f":(glob){p}/**/*.{e}" for p in paths for e in ("c", "h")],
                      "setup.py").returncode == 0
        here = _so_files(REPO, paths)
        if c_same and here:
            for rel in here:
                shutil.copy2(os.path.join(REPO, rel), os.path.join(root, _staged_path(rel)))
            native = "copied from the working tree (C sources and setup.py the same at the revision)"
        else:
            log(f"before: C sources at {rev} differ from the working tree's: building them (setup.py build_ext)")
            build = os.path.join(work, "build")
            _extract(commit, [], build)
            res = subprocess.run([python, "setup.py", "build_ext", "--inplace"], cwd=build, capture_output=True,
                                 text=True)
            built = _so_files(build, paths)
            if res.returncode or not built:
                tail = (res.stderr or res.stdout).strip().splitlines()[-5:]
                raise Refused(f"building {rev}'s native extensions failed: {' / '.join(tail)}")
            for rel in built:
                shutil.copy2(os.path.join(build, rel), os.path.join(root, _staged_path(rel)))
            missing = sorted({os.path.basename(p).split(".")[0] for p in here}
                             - {os.path.basename(p).split(".")[0] for p in built})
            native = "built from the revision" + (f" (not built: {', '.join(missing)})" if missing else "")
        info = {"rev": rev, "commit": commit, "native": native, "paths": paths}
        with open(os.path.join(root, STAGE_MARKER), "w") as f:
            json.dump(info, f, indent=2)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty (checked above)
        shutil.move(root, dest)
        log(f"before: staged {rev} ({commit[:12]}) at {dest}; native files {native}")
        return info
    finally:
        shutil.rmtree(work, ignore_errors=True)


# `python -c` puts the working directory first on sys.path; the repo root holds a radixtier/ dir,
# which would shadow PYTHONPATH's. A script's sys.path[0] is its own dir (bench/): the probe and
# the runs' wrapper below set exactly that.
PROBE = r"""
import importlib, json, os, sys
sys.path[0] = sys.argv[3]
out = {"modules": {}, "native": {}, "packages": {}}
for m in json.loads(sys.argv[1]):
    out["modules"][m] = importlib.import_module(m).__file__
for m in json.loads(sys.argv[2]):
    try:
        out["native"][m] = importlib.import_module(m).__file__
    except ImportError:
        out["native"][m] = None
for p in ("radixtier", "radixtier.storage", "radixtier.integrations"):
    try:
        out["packages"][p] = os.path.dirname(importlib.import_module(p).__file__)
    except ImportError:
        pass
print("PROBE" + json.dumps(out))
"""


def version_env(root: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if root:
        env["PYTHONPATH"] = root
    return env


def probe(python: str, bench: str, label: str, root: Optional[str]) -> Dict[str, object]:
    """Import the bench's radixtier modules as the version's runs will; check they come from its
    directory; list its native extensions and any built before their C sources last changed."""
    res = subprocess.run([python, "-c", PROBE, json.dumps(BENCHES[bench]["modules"]), json.dumps(NATIVE), HERE],
                         env=version_env(root), cwd=REPO, capture_output=True, text=True, timeout=300)
    line = next((x for x in res.stdout.splitlines() if x.startswith("PROBE")), None)
    if res.returncode or line is None:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        hint = " (the current tree mid-edit? try again in a few minutes)" if root is None else ""
        raise Refused(f"{label} version does not import: {last}{hint}")
    info = json.loads(line[len("PROBE"):])
    home = os.path.realpath(root or REPO)
    strays = [f"{m} -> {f}" for m, f in info["modules"].items() if not os.path.realpath(f).startswith(home + os.sep)]
    if strays:
        raise Refused(f"{label} version imports code from outside {home}: {'; '.join(strays)}")
    stale = []
    for pkg_dir in set(info["packages"].values()):
        for d, dirs, files in os.walk(pkg_dir):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            sos = [os.path.getmtime(os.path.join(d, f)) for f in files if f.endswith(".so")]
            srcs = [(os.path.getmtime(os.path.join(d, f)), f) for f in files if f.endswith((".c", ".h"))]
            if sos and srcs and max(srcs)[0] > min(sos) + 1:
                stale.append(f"{os.path.join(d, max(srcs)[1])} is newer than the .so beside it")
    info["stale_native"] = stale
    return info


def describe(label: str, root: Optional[str], staged: Optional[dict]) -> str:
    where = f"{root} (PYTHONPATH={root})" if root else f"the current tree {REPO} (editable install, no PYTHONPATH)"
    if staged:
        where += f", git {staged['rev']} = {staged['commit'][:12]}, native files {staged['native']}"
    return where


def check_ram_device(bench_args: Sequence[str]) -> None:
    """--ram-device needs root, losetup, mkfs.ext4 and a loop device: try a small one now, once."""
    if "--ram-device" not in bench_args:
        return
    from ramdevice import RamDeviceUnavailable, ram_device  # bench/ is sys.path[0] when run as a script
    try:
        with ram_device(64 << 20):
            pass
    except RamDeviceUnavailable as exc:
        raise Refused(f"--ram-device is unavailable here ({exc}); run as root on a machine with loop devices, "
                      "or leave it out: --replace-defaults -- <your args>") from None


# ---------------------------------------------------------------------------------------------
# running

# Runs the bench script as `python bench/<script>` would (sys.path[0] = bench/, __main__), then
# reports which files every radixtier module loaded came from (checked against the version's dir).
WRAPPER = r"""
import atexit, json, os, runpy, sys
script, report = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path[0] = os.path.dirname(script)
pid = os.getpid()
def _report():
    if os.getpid() == pid:
        with open(report, "w") as f:
            json.dump({m: getattr(mod, "__file__", None) for m, mod in list(sys.modules.items())
                       if m == "radixtier" or m.startswith("radixtier.")}, f)
atexit.register(_report)
runpy.run_path(script, run_name="__main__")
"""


def check_loaded(label: str, root: Optional[str], report: str) -> int:
    """How many radixtier modules the run loaded; refuses if one came from outside the version."""
    with open(report) as f:
        loaded = json.load(f)
    home = os.path.realpath(root or REPO)
    strays = [f"{m} -> {f}" for m, f in loaded.items() if f and not os.path.realpath(f).startswith(home + os.sep)]
    if strays:
        raise Refused(f"the {label} run loaded code from outside {home}: {'; '.join(strays[:5])}")
    return len(loaded)


def run_one(cmd: List[str], env: Dict[str, str], log_path: str, timeout: float) -> Tuple[object, float]:
    """Run the bench, its output into log_path; returns (exit code or 'timeout', seconds). Stopped
    with SIGINT first (its finally blocks remove the RAM device), then killed."""
    t = time.monotonic()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            rc: object = p.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            if not isinstance(exc, KeyboardInterrupt):  # a Ctrl-C reached the bench itself already
                p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if isinstance(exc, KeyboardInterrupt):
                raise
            rc = "timeout"
    return rc, time.monotonic() - t


def machine_cpu_s() -> Optional[float]:
    """CPU-seconds the whole machine has been busy (all CPUs, from /proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait (guest is inside user)
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _tail(path: str, n: int = 12) -> str:
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace").replace("\r", "\n")
    return "\n".join([x for x in text.splitlines() if x.strip()][-n:])


def check_result(bench: str, result: dict, bench_args: Sequence[str], log_path: str) -> None:
    metrics, _ = COLLECTORS[bench](result)
    if bench == "l3" and "--ram-device" in bench_args and not any(r.get("where") == "ram-device"
                                                                  for r in result.get("rows", [])):
        why = next((x for x in _tail(log_path, 200).splitlines() if "RAM device skipped" in x), "no RAM-device rows")
        raise Refused(f"the bench ran without the RAM device: {why.strip()}")
    if not metrics:
        raise Refused(f"the bench reported no figures (log: {log_path})")


def parse_args(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, List[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1:]
    defaults = "\n".join(f"  {k:<5} {' '.join(v['defaults'])}" for k, v in BENCHES.items())
    ap = argparse.ArgumentParser(prog="compare_versions.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1] + f"\ndefault bench arguments:\n{defaults}\n")
    ap.add_argument("bench", choices=sorted(BENCHES), help="l3: bench/l3_bandwidth.py; tree: bench/tree_ops.py")
    ap.add_argument("--before", required=True, metavar="PATH",
                    help="the before version: a dir holding radixtier/ (with storage/, integrations/ and the .so "
                         "files inside it), as /tmp/rt/before; with --before-rev, where that revision is staged")
    ap.add_argument("--before-rev", metavar="REV",
                    help="stage git revision REV of this repo at --before PATH first (git archive; native .so "
                         "files copied from this tree if the C sources are the same at REV, else built)")
    ap.add_argument("--after", metavar="PATH", default=None,
                    help="the after version, laid out as --before (default: the current tree, no PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds, each runs both versions (default 5)")
    ap.add_argument("--out", default=None,
                    help="JSON to write; the Markdown goes beside it (default bench/results/compare_<bench>.json)")
    ap.add_argument("--replace-defaults", action="store_true",
                    help="pass the bench only your own arguments, not the defaults listed below")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="flag a figure slower/faster when its ratio is beyond this fraction (and beyond the "
                         "references' noise) and every round agrees (default 0.05)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one bench run may take (default 900)")
    ap.add_argument("--all", action="store_true", help="print every figure (p10/p90, SGLang sweep, slopes), "
                                                       "not only the main ones (the Markdown file has all)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the temp dir with each run's JSON and log")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the bench runs (default: this one)")
    a, extra = ap.parse_known_args(argv)
    bench_args = ([] if a.replace_defaults else list(BENCHES[a.bench]["defaults"])) + extra + tail
    if any(x == "--out" or x.startswith("--out=") for x in extra + tail):
        ap.error("--out is this script's option (each bench run writes into a temp dir)")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    a.out = a.out or os.path.join(REPO, "bench", "results", f"compare_{a.bench}.json")
    return a, bench_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    a, bench_args = parse_args(argv)
    try:
        return _main(a, bench_args)
    except Refused as exc:
        print(f"compare_versions: {exc}", file=sys.stderr)
        return 2


def _main(a: argparse.Namespace, bench_args: List[str]) -> int:
    from tqdm import tqdm

    t_start = time.monotonic()
    staged = stage_rev(a.before_rev, a.before, a.python, log=lambda s: print(s, file=sys.stderr)) \
        if a.before_rev else None
    roots = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after) if a.after else None}
    for label in VERSIONS:
        r = roots[label]
        if r and not os.path.isfile(os.path.join(r, "radixtier", "__init__.py")):
            raise Refused(f"--{label} {r}: no radixtier/__init__.py there (a version dir holds radixtier/, "
                          "with storage/ and integrations/ inside it)")
    if roots["before"] == roots["after"]:
        raise Refused("--before and --after are the same directory")
    meta: Dict[str, object] = {"bench": a.bench, "script": os.path.join(HERE, BENCHES[a.bench]["script"]),
                               "bench_args": bench_args, "rounds": a.rounds, "tolerance": a.tolerance,
                               "python": a.python, "versions": {}}
    warnings: List[str] = []
    for label in VERSIONS:
        info = probe(a.python, a.bench, label, roots[label])
        info.update(root=roots[label], describe=describe(label, roots[label], staged if label == "before" else None),
                    staged=staged if label == "before" else None)
        meta["versions"][label] = info
        warnings += [f"{label}: {s} (rebuild: python setup.py build_ext --inplace)" for s in info["stale_native"]]
        print(f"{label}: {info['describe']}", file=sys.stderr)
    nat = {label: {m for m, f in meta["versions"][label]["native"].items() if f} for label in VERSIONS}
    if nat["before"] != nat["after"]:
        warnings.append(f"native extensions differ: before has {sorted(nat['before'])}, after {sorted(nat['after'])} "
                        "(a missing one runs its slower pure-Python stand-in)")
    if a.bench == "l3":
        check_ram_device(bench_args)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    tmp = tempfile.mkdtemp(prefix=f"radixtier-compare-{a.bench}-")
    script = meta["script"]
    runs: List[Dict[str, object]] = []
    order: List[str] = []
    ok = False
    try:
        bar = tqdm(total=2 * a.rounds, unit="run", desc=f"{a.bench} before/after", file=sys.stderr)
        for r in range(a.rounds):
            labels = VERSIONS if r % 2 == 0 else VERSIONS[::-1]
            order.append(" then ".join(labels))
            for label in labels:
                bar.set_postfix_str(f"round {r + 1}/{a.rounds}: {label}")
                out = os.path.join(tmp, f"r{r + 1}-{label}.json")
                log_path = os.path.join(tmp, f"r{r + 1}-{label}.log")
                report = os.path.join(tmp, f"r{r + 1}-{label}.modules.json")
                m0, c0 = machine_cpu_s(), children_cpu_s()
                rc, secs = run_one([a.python, "-c", WRAPPER, script, report, *bench_args, "--out", out],
                                   version_env(roots[label]), log_path, a.timeout)
                # CPU the rest of the machine used meanwhile (other processes, and kernel threads
                # working for the bench: the loop device's), in CPUs on average over the run
                others = None if m0 is None else max(0.0, (machine_cpu_s() - m0) - (children_cpu_s() - c0)) / secs
                if rc != 0 or not os.path.isfile(out):
                    raise Refused(f"round {r + 1}, {label}: the bench "
                                  f"{'timed out' if rc == 'timeout' else f'exited {rc}'} after {secs:.0f} s; "
                                  f"last lines of {log_path}:\n{_tail(log_path)}")
                with open(out) as f:
                    result = json.load(f)
                check_result(a.bench, result, bench_args, log_path)
                n_mod = check_loaded(label, roots[label], report)
                runs.append({"round": r + 1, "version": label, "seconds": round(secs, 1), "radixtier_modules": n_mod,
                             "other_cpus": others, "result": result})
                bar.update()
                tqdm.write(f"round {r + 1} {label}: {secs:.0f} s" + ("" if others is None else
                           f", the rest of the machine busy {others:.2f} CPUs on average"), file=sys.stderr)
        bar.close()
        ok = True
    finally:
        if ok and not a.keep_runs:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"runs' JSON and logs kept in {tmp}", file=sys.stderr)

    cmp = compare(a.bench, runs, a.tolerance)
    warnings += cmp["warnings"]
    meta["order"] = "; ".join(f"round {i + 1}: {o}" for i, o in enumerate(order))
    meta["wall_s"] = time.monotonic() - t_start
    meta["cpus"] = os.cpu_count()
    busy = {label: [x["other_cpus"] for x in runs if x["version"] == label and x["other_cpus"] is not None]
            for label in VERSIONS}
    meta["other_cpus"] = busy
    head = header_lines(a.bench, meta)
    main_table = format_table(cmp, ("main",))
    detail = format_table(cmp, ("detail",))
    peak = max((x for v in busy.values() for x in v), default=0.0)
    if peak > 0.5:
        warnings.append(f"the rest of the machine kept up to {peak:.2f} of its {meta['cpus']} CPUs busy during "
                        "the runs (other processes?): the figures are noisy; compare on a quiet machine")
    tail = summary_lines(cmp) + [f"warning: {w}" for w in warnings]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({**meta, "warnings": warnings, "noise": cmp["noise"], "flag_bounds": cmp["flag_bounds"],
                   "metrics": cmp["metrics"], "runs": runs}, f, indent=1)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        text = head + [main_table, ""] + tail
        if "|" in detail.splitlines()[-1] and len(detail.splitlines()) > 2:
            text += ["", "## More figures", "", detail]
        f.write("\n".join(text) + "\n")
    print("\n".join(head + [format_table(cmp, ("main", "detail") if a.all else ("main",)), ""] + tail))
    print(f"\nwrote {a.out}, {md} ({meta['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
