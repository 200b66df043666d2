"""`radixtier` command line: demo, format, inspect, index, plan."""

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
    print(f"  {'partition':>9s} {'slots':>8s} {'used':>8s} {'tagged':>8s}  owner (state)")
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
        print(f"  {p['partition']:9d} {p['slots']:8d} {p['used']:8d} {p['tagged']:8d}  {who} ({state})")
    if rep["verified"]:
        print(f"  errors: {len(rep['errors'])}")
        for e in rep["errors"][:20]:
            print(f"    partition {e['partition']} slot {e['slot']} key {e['key']}: {e['error']}")
    return 1 if rep["errors"] else 0


def _index_config(a: argparse.Namespace):
    """The same RedisIndexConfig (and so the same checks and one-line errors) as the SGLang plugin."""
    import os

    from radixtier.storage.index.redis_index import RedisIndexConfig

    url = a.url or os.environ.get("RADIXTIER_REDIS_URL")
    if not url:
        raise ValueError("redis_url: give --url redis://host:port/db (or set RADIXTIER_REDIS_URL)")
    timeout = _timeout(a.timeout)
    return RedisIndexConfig(url=url, node_id="radixtier-admin", namespace=a.namespace, key_prefix=a.key_prefix,
                            username=a.username, password=a.password or os.environ.get("RADIXTIER_REDIS_PASSWORD"),
                            cluster=a.cluster, ssl_ca_certs=a.ssl_ca_certs, ssl_certfile=a.ssl_certfile,
                            ssl_keyfile=a.ssl_keyfile, ssl_cert_reqs=a.ssl_cert_reqs, lookup_timeout_s=timeout,
                            connect_timeout_s=timeout, write_timeout_s=max(5.0, timeout))


_MAX_TIMEOUT_S = 600.0  # an operator's tool waiting longer on one reply is a typo, not a slow Redis


def _timeout(text: str) -> float:
    """--timeout as seconds in (0, 600]; its text is parsed here so that every bad value ('soon', nan,
    1e308, which overflowed the socket timeout with a traceback) is one line naming the option."""
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 < seconds <= _MAX_TIMEOUT_S:  # false for nan too
        raise ValueError(f"--timeout: expected a positive number of seconds up to {_MAX_TIMEOUT_S:g}, got {text!r}")
    return seconds


def _human_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _cmd_index(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from radixtier.storage.index.redis_admin import collect_all_garbage, ensure_reachable, fleet_status
    from radixtier.storage.index.redis_index import RedisPrefixIndex

    if a.action is None:
        raise ValueError("index: give an action, status or gc (radixtier index --help)")
    import logging

    logging.getLogger("radixtier.storage.redis").setLevel(logging.ERROR)  # errors come back as one line
    index = RedisPrefixIndex(_index_config(a), serve=False)
    try:
        ensure_reachable(index)
        if a.action == "gc":
            removed = collect_all_garbage(index)
            out = {"removed_pages": removed, "repaired": index.registry_problems()}  # bad registry data met
            print(json.dumps(out) if a.json else f"removed the records of {removed} page(s) of dead nodes")
            if not a.json:
                _print_problems("repaired", out["repaired"])
            return 0
        with tqdm(desc="nodes", unit="node", file=sys.stderr, delay=1.0, disable=a.json) as bar:
            rep = fleet_status(index, check=a.check, progress=bar.update)
    finally:
        index.close()
    if a.json:
        print(json.dumps(rep, indent=2))
        return 0
    print(f"{rep['url']} namespace {rep['namespace']!r}: {rep['live']} live, {rep['dead']} dead node(s); "
          f"Redis uses {_human_bytes(rep['redis_used_memory_bytes'])} in all")
    head = f"  {'node':24s} {'state':6s} {'last heartbeat':>15s} {'pages':>9s} {'chains':>7s} {'memory':>10s}"
    print(head + ("  rejected" if a.check else ""))
    for r in rep["nodes"]:
        beat = "-" if r["last_heartbeat_s_ago"] is None else f"{r['last_heartbeat_s_ago']:.1f} s ago"
        line = (f"  {r['node'][:24]:24s} {'live' if r['alive'] else 'dead':6s} {beat:>15s} {r['pages']:9d} "
                f"{r['chains']:7d} {_human_bytes(r['redis_bytes']):>10s}")
        print(line + (f"  {r['rejected_entries']:8d}" if a.check else ""))
    if rep["dead"]:
        print("  dead nodes' records are ignored by lookups; `radixtier index gc` removes them now")
    _print_problems("problems", rep["problems"])
    return 0


def _print_problems(title: str, problems: List[str]) -> None:
    """Bad registry data the index met (each on its own line): reported, never a reason to stop."""
    if problems:
        print(f"  {title} in the registry data:")
        for p in problems:
            print(f"    {p}")


def _add_index_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Redis (the same settings as the SGLang plugin's redis_* keys)")
    g.add_argument("--url", default=None, help="redis://, rediss:// or unix:// URL (default: $RADIXTIER_REDIS_URL)")
    g.add_argument("--namespace", default="default", help="the index namespace (the plugin's redis_namespace)")
    g.add_argument("--key-prefix", default="radixtier", help="key prefix (the plugin's redis_key_prefix)")
    g.add_argument("--username", default=None, help="ACL user")
    g.add_argument("--password", default=None, help="password (default: $RADIXTIER_REDIS_PASSWORD)")
    g.add_argument("--cluster", action="store_true", help="the URL is a Redis Cluster node")
    g.add_argument("--ssl-ca-certs", default=None, help="CA bundle for rediss://")
    g.add_argument("--ssl-certfile", default=None, help="client certificate for rediss://")
    g.add_argument("--ssl-keyfile", default=None, help="client key for rediss://")
    g.add_argument("--ssl-cert-reqs", default="required", help="required, optional or none (rediss:// only)")
    g.add_argument("--timeout", default="2", help="seconds to wait for Redis (default 2, at most 600)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _cmd_plan(a: argparse.Namespace) -> int:
    from radixtier import costmodel as plan

    geom = plan.geometry_from_args(a)  # every number (flags, --config) checked before any measurement
    inputs = plan.inputs_from_args(a)
    if a.png:
        plan.check_output_path("--png", a.png)
    if a.measure:
        from tqdm import tqdm

        with tqdm(desc="measure", unit="page", file=sys.stderr, delay=1.0, disable=a.json) as bar:
            tier = plan.measure_read_gbps(a.measure, progress=bar.update)
        if not a.json:
            print(f"measured: {tier:.2f} GB/s verified reads on {a.measure} (used as --tier-gbps)")
        inputs = plan.inputs_from_args(a, tier)
    p = plan.predict(geom, inputs)
    p["verdict"] = plan.verdict(p)
    if a.png:
        plan.plot(geom, inputs, a.png)  # raises (one line naming --png) unless every byte was written
    if a.json:
        print(json.dumps(p, indent=2))
    else:
        print(plan.format_report(p))
        if a.png:
            print(f"plot written to {a.png}")
    return 0


def _cmd_demo(a: argparse.Namespace) -> int:
    if a.embedded:
        from radixtier.demo.run import run_demo

        return run_demo(a)
    from radixtier.demo.server_demo import run_server_demo

    return run_server_demo(a)


def _cmd_pool_events(a: argparse.Namespace) -> int:
    import signal
    import threading

    from radixtier.integrations.sglang.backend.config import ZMQ_TRANSPORTS

    if not 0.1 <= a.report_s <= 86400:  # also refuses nan
        raise ValueError(f"--report-s: expected 0.1..86400 seconds, got {a.report_s}")
    partitions, sources = [], []
    for value in a.source:  # PARTITION=ENDPOINT or ENDPOINT
        head, sep, rest = value.partition("=")
        if sep and head.isdigit() and len(head) <= 3:
            partitions.append(int(head))
            sources.append(rest)
        else:
            partitions.append(None)
            sources.append(value)
    if any(p is not None for p in partitions) and a.namespace is None:
        raise ValueError("--source: PARTITION=ENDPOINT needs --namespace (the namespace those partitions are of)")
    for name, value in [("--source", s) for s in sources] + [("--endpoint", a.endpoint),
                                                             ("--replay-endpoint", a.replay_endpoint)]:
        if value is not None and ("://" not in value or value.split("://", 1)[0] not in ZMQ_TRANSPORTS):
            raise ValueError(f"{name}: expected a ZMQ endpoint such as tcp://host:5557, got {value[:200]!r}")
    from radixtier.fleet.pool_http import parse_listen, serve
    from radixtier.fleet.pool_stream import PoolStream

    if a.http is not None:
        parse_listen(a.http)
    pool = PoolStream(sources, a.endpoint, a.replay_endpoint, topic=a.topic, source_topic=a.source_topic,
                      namespace=a.namespace, partitions=partitions)
    http = None
    try:
        http = serve(pool, a.http) if a.http is not None else None
    except OSError:
        pool.close()
        raise
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    st = pool.stats()
    print(f"radixtier pool-events: {len(sources)} node stream(s) -> {a.endpoint} (medium EXTERNAL)"
          + (f"; read {st['read_from_namespace']:,} page(s) from {a.namespace}" if a.namespace else "")
          + (f"; POST http://{a.http}/fleet_view" if a.http else "") + "; Ctrl-C stops", flush=True)
    try:
        while not stop.wait(a.report_s):
            st = pool.stats()
            print(f"blocks in pool {st['blocks_in_pool']:,}  stored {st['blocks_stored']:,}  removed "
                  f"{st['blocks_removed']:,}  batches in {st['batches_in']:,} out {st['batches_out']:,}  "
                  f"undecodable {st['decode_errors']}  untracked {st['untracked']}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if http is not None:
            http.shutdown()
        pool.close()
    return 0


def version_report() -> str:
    """`radixtier --version`: the version, and which native parts this install runs or what stands in."""
    import importlib.util

    from radixtier import __version__
    from radixtier.storage.nvmeof.io_engine import deadline_check_reason, uring_unusable_reason

    uring = uring_unusable_reason()
    fence = deadline_check_reason()
    lines = [f"radixtier {__version__}",
             "tier-3 I/O: " + ("io_uring, radixtier's native page core" if uring is None
                               else f"the preadv/pwritev thread pool (io_uring: {uring})"),
             "lease write deadlines: " + ("checked in C right before each write" if fence is None else fence),
             "page pool frees: " + ("one native pass (radixtier._slotpool)" if importlib.util.find_spec(
                 "radixtier._slotpool") else "numpy (radixtier._slotpool is not built: no C compiler at install)")]
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def build_parser(command: Optional[str] = None, embedded: bool = False) -> argparse.ArgumentParser:
    """The parser; the demo's own options (which import torch and the toy model) are added only
    when `command` is "demo", so format/inspect stay light: SGLang's real server demo's, or with
    --embedded the embedded engine's."""
    ap = argparse.ArgumentParser(prog="radixtier", description="radixtier: three-tier prefix KV cache for SGLang")
    ap.add_argument("--version", action=_VersionAction,
                    help="print the version and which native parts (io_uring core, lease fence) this install runs")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("demo", help="SGLang's real server with radixtier vs recompute: chat and agents, TTFT and "
                                    "reuse per tier (--embedded: radixtier's own engine)")
    d.add_argument("--embedded", action="store_true",
                   help="the embedded-engine demo instead (radixtier's own three tiers, no SGLang; its options: "
                        "radixtier demo --embedded --help)")
    if command == "demo":
        if embedded:
            from radixtier.demo.run import add_demo_arguments

            add_demo_arguments(d)
        else:
            from radixtier.demo.server_demo import add_server_demo_arguments

            add_server_demo_arguments(d)
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
    x = sub.add_parser("index", help="the fleet's prefix index in Redis: who holds what; remove dead nodes' records",
                       description="Read the prefix index the SGLang plugin (or TieredKVCache) keeps in Redis: "
                                   "`status` lists every node with its heartbeat, pages, chains and memory; "
                                   "`gc` removes the records of nodes whose heartbeat expired (lookups already "
                                   "ignore them; this frees the memory now).")
    xs = x.add_subparsers(dest="action", metavar="ACTION")
    st = xs.add_parser("status", help="nodes live/dead, last heartbeat, pages and chains per node, memory")
    _add_index_arguments(st)
    st.add_argument("--check", action="store_true", help="also read every chain log and count bad entries")
    gc = xs.add_parser("gc", help="remove dead nodes' records now")
    _add_index_arguments(gc)
    x.set_defaults(fn=_cmd_index, action=None)
    pe = sub.add_parser("pool-events", help="the shared namespace's tier-3 pages as one KV-event stream "
                                            "(medium EXTERNAL) for the fleet's router",
                        description="Subscribe to the nodes' KV-event streams (SGLang's --kv-events-config with "
                                    "publisher radixtier) and publish, in SGLang's format, the pages any node "
                                    "holds in the shared namespace: BlockStored (EXTERNAL) when the first node "
                                    "announces a page, BlockRemoved when the last one removes it. Register the "
                                    "stream with the router as one more source: a match on it means any node "
                                    "attached to the namespace can load that prefix from tier 3.",
                        epilog="example: radixtier pool-events --namespace /dev/nvme1n1 --source 0=tcp://node-a:5557 "
                               "--source 1=tcp://node-b:5557 --endpoint 'tcp://*:5600'")
    pe.add_argument("--source", action="append", required=True, metavar="[PARTITION=]ENDPOINT",
                    help="a node's KV-event endpoint (repeat for every node); with PARTITION= (the partition "
                         "the node writes) and --namespace, what that partition already holds is read at start "
                         "and again when the node restarts")
    pe.add_argument("--namespace", default=None, metavar="PATH",
                    help="the shared namespace (block device or file), read-only: the pool starts from what "
                         "the partitions named in --source hold, not only from what is announced while it runs")
    pe.add_argument("--endpoint", required=True, help="where to publish the pool's stream, e.g. tcp://*:5600")
    pe.add_argument("--replay-endpoint", default=None, help="optional ZMQ ROUTER endpoint for missed batches")
    pe.add_argument("--topic", default="", help="topic of the pool's stream (default: none)")
    pe.add_argument("--source-topic", default="", help="topic the nodes publish on (default: all)")
    pe.add_argument("--http", default=None, metavar="HOST:PORT",
                    help="also answer POST /fleet_view {\"block_hashes\": [...]} here: per node, the leading "
                         "blocks in its own tier 3 (disk) and in the shared pool (external)")
    pe.add_argument("--report-s", type=float, default=10.0, help="seconds between status lines (default 10)")
    pe.set_defaults(fn=_cmd_pool_events)
    pl = sub.add_parser("plan", help="predict TTFT and throughput: recompute vs local NVMe vs tiered NVMe-oF",
                        description="A cost model (radixtier/costmodel.py states every assumption) of TTFT and "
                                    "throughput for recomputing a prefix, reloading it from local NVMe, and "
                                    "reloading it from tiered NVMe-oF, for your model and workload.",
                        epilog="example: radixtier plan --config Llama-3.1-70B/config.json --prefill-tps 20000 "
                               "--context 32768 --hit-rate 0.9 --concurrency 16 --measure /mnt/nvmeof")
    # plan's numbers have no argparse type: plan.check_value reads the text, so a bad one is one line naming the
    # option and its range (argparse would print its usage too, and accepts nan, inf and 400-digit ints)
    m = pl.add_argument_group("model KV geometry (a Hugging Face config.json, or the numbers)")
    m.add_argument("--config", default=None, help="the model's config.json (GQA/MHA or DeepSeek-style MLA)")
    m.add_argument("--layers", default=None, help="transformer layers")
    m.add_argument("--kv-heads", default=None, help="KV heads (GQA/MHA)")
    m.add_argument("--head-dim", default=None, help="head dimension (GQA/MHA)")
    m.add_argument("--mla-dim", default=None, help="kv_lora_rank + qk_rope_head_dim (MLA)")
    m.add_argument("--dtype-bytes", default=2, help="bytes per KV element (2 for bf16)")
    w = pl.add_argument_group("workload")
    w.add_argument("--context", default=32768, help="prompt tokens per request")
    w.add_argument("--hit-rate", default=0.9, help="share of the prompt that is a cached prefix (0..1)")
    w.add_argument("--concurrency", default=8, help="requests in flight at once")
    h = pl.add_argument_group("hardware")
    h.add_argument("--prefill-tps", default=20000.0, help="prefill tokens per second of the GPUs")
    h.add_argument("--prefill-overhead-s", default=0.0, help="fixed seconds per prefill")
    h.add_argument("--prefix-cost-us-per-token", default=0.0,
                   help="microseconds per reused prefix token in the prefill that reuses it (KV in, attention)")
    h.add_argument("--local-gbps", default=3.0, help="local NVMe read GB/s")
    h.add_argument("--tier-gbps", default=5.0, help="NVMe-oF target read GB/s")
    h.add_argument("--net-gbps", default=12.5, help="network GB/s between GPU nodes and the target")
    h.add_argument("--measure", default=None, metavar="PATH",
                   help="measure --tier-gbps with the store's own reads on a temporary namespace in PATH")
    pl.add_argument("--png", default=None, help="also plot TTFT vs context length for the three paths")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(fn=_cmd_plan)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    ap = build_parser(next((x for x in args if not x.startswith("-")), None), embedded="--embedded" in args)
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
