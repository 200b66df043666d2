"""`radixtier` command line: demo, format, inspect."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from radixtier.units import parse_size


def parse_bytes(text: str) -> int:
    """'4MiB', '256k', '1g', '4096' -> bytes (an argparse type)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_format(a: argparse.Namespace) -> int:
    from radixtier.storage.nvmeof.store import format_namespace

    sb = format_namespace(a.path, a.page_bytes, a.capacity, a.partitions, force=a.force)
    print(f"formatted {a.path}: uuid {sb.uuid}, {sb.slot_count} slots of {sb.page_bytes} bytes "
          f"({sb.partitions} partition(s), {sb.total_bytes / 2**30:.2f} GiB)")
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from radixtier.storage.nvmeof.inspect import inspect_namespace

    bar = tqdm(desc="verify", unit="page", file=sys.stderr, disable=not a.verify, delay=0.5)  # silent if quick
    try:
        rep = inspect_namespace(a.path, verify=a.verify, progress=bar.update)
    finally:
        bar.close()
    if a.json:
        print(json.dumps(rep, indent=2))
        return 1 if rep["errors"] else 0
    print(f"{rep['path']}: radixtier namespace v{rep['version']} uuid {rep['uuid']}")
    print(f"  page bytes {rep['page_bytes']}, slot bytes {rep['slot_bytes']}, {rep['slots']} slots, "
          f"{rep['used']} used ({100 * rep['used'] / max(1, rep['slots']):.1f}%)")
    print(f"  {'partition':>9s} {'slots':>8s} {'used':>8s}  owner (state)")
    for p in rep["partitions"]:
        if p["clean"] is None:
            state = "never opened"
        elif p["clean"]:
            state = "closed cleanly"
        elif p["held"]:
            state = f"held, lease expires in {p['expires_in_s']} s unless renewed"
        else:
            state = "lease expired: its holder stopped without closing"
        who = f"{p['owner']} on {p['host']} pid {p['pid']}" if p["owner"] else "-"
        print(f"  {p['partition']:9d} {p['slots']:8d} {p['used']:8d}  {who} ({state})")
    if rep["verified"]:
        print(f"  errors: {len(rep['errors'])}")
        for e in rep["errors"][:20]:
            print(f"    partition {e['partition']} slot {e['slot']} key {e['key']}: {e['error']}")
    return 1 if rep["errors"] else 0


def _cmd_demo(a: argparse.Namespace) -> int:
    from radixtier.demo.run import run_demo

    return run_demo(a)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; the demo's own options (which import torch and the toy model) are added only
    when `command` is "demo", so format/inspect stay light."""
    ap = argparse.ArgumentParser(prog="radixtier",
                                 description="Three-tier (HBM / DRAM / NVMe-oF) prefix KV cache for SGLang.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("demo", help="serve a multi-turn and an agent workload through the tiers; TTFT vs recompute")
    if command == "demo":
        from radixtier.demo.run import add_demo_arguments

        add_demo_arguments(d)
    d.set_defaults(fn=_cmd_demo)
    f = sub.add_parser("format", help="format a block device or file as a radixtier namespace")
    f.add_argument("path", help="block device (e.g. /dev/nvme1n1) or file")
    f.add_argument("--page-bytes", type=parse_bytes, required=True, help="bytes per KV page (e.g. 256KiB)")
    f.add_argument("--capacity", type=parse_bytes, default=None,
                   help="namespace size (default: the whole device; required for a new file)")
    f.add_argument("--partitions", type=int, default=1, help="slot ranges, one per node sharing it (1..64)")
    f.add_argument("--force", action="store_true", help="overwrite an existing namespace or other data")
    f.set_defaults(fn=_cmd_format)
    i = sub.add_parser("inspect", help="report slots used, pages and errors of a namespace (read-only)")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true", help="read every used page and check it")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_cmd_inspect)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser(next((x for x in args if not x.startswith("-")), None))
    a = ap.parse_args(args)
    if not getattr(a, "fn", None):
        ap.print_help()
        return 2
    try:
        return a.fn(a)
    except (ValueError, RuntimeError, OSError) as exc:  # one line, never a traceback, for what an operator can fix
        print(f"radixtier {a.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
