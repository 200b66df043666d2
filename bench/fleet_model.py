"""Fleet-scale model of the prefix index and the tier-3 event stream: measured on loopback, extrapolated.

Measured here (a private redis-server on a free loopback port, an ipc:// ZMQ socket):

  index    bytes of Redis memory per page record (INFO used_memory before/after publishing R records
           in chains of --chain-pages, node "n0"; keys and overhead included) and Redis keys per record;
           publish and unpublish throughput (records/s until flush); chain lookups/s of lookup_locations()
           on a --chain-pages chain with 1 and several client processes (the best is the shard's figure)
  events   bytes per tier-3 BlockStored / BlockRemoved event on the wire (topic + sequence + msgpack of a
           KVEventBatch, as SGLang's ZmqEventPublisher sends it) for 1 and --chain-pages blocks, with and
           without --page-tokens token ids per block; encode+publish rate on a PUB socket and the rate one
           SUB (a router) drains and decodes them (events/s, MB/s)

Extrapolated (pure functions, tests/test_fleet_model.py): index memory for --pages records fleet-wide,
lookups/s for --requests-per-s, writes/s (stores + as many removals: a full fleet evicts what it
stores), events/s and bytes/s fleet-wide; Redis shards needed for each of memory, lookup rate and write
rate, routers (subscribers) needed for the event stream; which saturates first.

Assumptions the model states in its output: one holder per page (records = pages); a lookup's cost is
per call up to --chain-pages pages (conservative for shorter chains) and grows with pages beyond;
lookups know their chain's root (one MGET; without it a GET of the root pointer comes first, on the
first page's own slot); in Redis Cluster a chain's page records share one hash slot ({root}), so
memory, lookups and writes spread over shards by chain root, evenly when many roots are busy (one hot
root stays on one shard: replicas, not shards, help it); the loopback figures come from a machine where
client and server share its CPUs, so per-shard rates are lower bounds for a dedicated Redis host.

    python bench/fleet_model.py [--quick] [--nodes 1000] [--pages 100e6] [--requests-per-s 10000] \\
        [--out bench/results/fleet_model.json]

Writes JSON and Markdown beside --out. Default run about 2 minutes on 2 CPUs; --quick about 20 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import random
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

NS = "ab" * 16
TOPIC = b"radixtier"
GIB = 1 << 30


# ====================================================================== the model (pure, tested)
def _positive(name: str, value: object, whole: bool = False) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive number, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if whole and v != int(v):
        raise ValueError(f"{name}: expected a whole number, got {value!r}")
    return v


def validate_inputs(inputs: Dict[str, object]) -> Dict[str, float]:
    """The fleet's figures, checked; raises a one-line ValueError naming the bad option."""
    out: Dict[str, float] = {}
    for name, whole in (("nodes", True), ("pages", True), ("requests_per_s", False), ("pages_per_request", True),
                        ("new_pages_per_request", True), ("shard_memory_gib", False)):
        out[name] = _positive("--" + name.replace("_", "-"), inputs.get(name), whole)
    wp = inputs.get("write_pages_per_s")
    out["write_pages_per_s"] = (out["requests_per_s"] * out["new_pages_per_request"] if wp is None
                                else _positive("--write-pages-per-s", wp))
    fill = _positive("--usable-memory", inputs.get("usable_memory", 0.75))
    if fill > 1:
        raise ValueError(f"--usable-memory: expected a fraction of the shard's memory in (0, 1], got {fill!r}")
    out["usable_memory"] = fill
    if out["new_pages_per_request"] > out["pages_per_request"]:
        raise ValueError(f"--new-pages-per-request: {out['new_pages_per_request']:g} exceeds --pages-per-request "
                         f"{out['pages_per_request']:g}")
    return out


def shards_needed(demand: float, per_shard: float) -> int:
    """Whole shards (at least 1) for `demand` when one shard handles `per_shard`."""
    if not (math.isfinite(per_shard) and per_shard > 0):
        raise ValueError(f"per-shard capacity: expected a positive number, got {per_shard!r}")
    if not (math.isfinite(demand) and demand >= 0):
        raise ValueError(f"demand: expected a non-negative number, got {demand!r}")
    return max(1, math.ceil(demand / per_shard - 1e-9))


def event_bytes(sizes: Dict[int, float], blocks: float) -> float:
    """Wire bytes of an event of `blocks` blocks, linear between the measured sizes (1 and N blocks)."""
    (n1, b1), (n2, b2) = sorted(sizes.items())[0], sorted(sizes.items())[-1]
    if n1 == n2:
        return b1 * blocks / n1
    return b1 + (b2 - b1) * (blocks - n1) / (n2 - n1)


def lookup_capacity(lookups_per_s: float, measured_pages: int, pages_per_request: float) -> float:
    """Chain lookups/s one shard answers for chains of `pages_per_request` pages: per call up to the
    measured chain length (conservative below it), in proportion to pages beyond it."""
    return lookups_per_s * min(1.0, measured_pages / pages_per_request)


def verdict(loads: Dict[str, float]) -> Tuple[str, List[Tuple[str, float]]]:
    """The resource that saturates first (largest load, in units of one shard/subscriber) and all of
    them, most loaded first."""
    if not loads:
        raise ValueError("verdict: no loads given")
    ranked = sorted(loads.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[0][0], ranked


def model(inputs: Dict[str, object], measured: Dict[str, object]) -> Dict[str, object]:
    """The extrapolation: what the fleet needs, against what one shard / one subscriber measured."""
    f = validate_inputs(inputs)
    bpr = _positive("bytes_per_record", measured["bytes_per_record"])
    index_bytes = f["pages"] * bpr
    usable = f["shard_memory_gib"] * GIB * f["usable_memory"]
    lookup_cap = lookup_capacity(_positive("lookups_per_s", measured["lookups_per_s"]),
                                 int(measured["chain_pages"]), f["pages_per_request"])
    pub_cap = _positive("publish_records_per_s", measured["publish_records_per_s"])
    unpub_cap = _positive("unpublish_records_per_s", measured.get("unpublish_records_per_s", pub_cap))
    stores = f["write_pages_per_s"]
    removals = stores  # steady state: a full fleet evicts (and unpublishes) as many pages as it stores
    write_load = stores / pub_cap + removals / unpub_cap  # shard-seconds per second
    lookup_load = f["requests_per_s"] / lookup_cap
    memory_load = index_bytes / usable
    calls = stores / f["new_pages_per_request"]  # one BlockStored per write call (its new pages, one chain)
    blocks = f["new_pages_per_request"]
    stored_b = event_bytes({int(k): v for k, v in measured["stored_bytes"].items()}, blocks)
    stored_tok_b = event_bytes({int(k): v for k, v in measured["stored_bytes_tokens"].items()}, blocks)
    removed_b = event_bytes({int(k): v for k, v in measured["removed_bytes"].items()}, blocks)
    events_per_s = 2 * calls  # stores + as many removals
    sub_cap = _positive("subscriber_events_per_s", measured["subscriber_events_per_s"])
    event_load = events_per_s / sub_cap
    loads = {"memory": memory_load, "lookup rate": lookup_load, "write rate": write_load,
             "event stream": event_load}
    first, ranked = verdict(loads)
    return {
        "inputs": f,
        "index_bytes": index_bytes, "index_gib": index_bytes / GIB, "usable_bytes_per_shard": usable,
        "pages_per_node": f["pages"] / f["nodes"],
        "lookups_per_s": f["requests_per_s"], "pages_looked_up_per_s": f["requests_per_s"] * f["pages_per_request"],
        "lookup_capacity_per_shard": lookup_cap,
        "stores_per_s": stores, "removals_per_s": removals, "publish_capacity_per_shard": pub_cap,
        "unpublish_capacity_per_shard": unpub_cap,
        "events_per_s": events_per_s, "events_per_s_per_node": events_per_s / f["nodes"],
        "event_bytes_stored": stored_b, "event_bytes_stored_tokens": stored_tok_b, "event_bytes_removed": removed_b,
        "event_bytes_per_s": calls * (stored_b + removed_b),
        "event_bytes_per_s_tokens": calls * (stored_tok_b + removed_b),
        "subscriber_events_per_s": sub_cap,
        "loads": loads,
        "shards": {"memory": shards_needed(index_bytes, usable),
                   "lookup rate": shards_needed(f["requests_per_s"], lookup_cap),
                   "write rate": shards_needed(write_load, 1.0),
                   "lookups + writes (one CPU)": shards_needed(lookup_load + write_load, 1.0)},
        "subscribers": shards_needed(events_per_s, sub_cap),
        "saturates_first": first, "ranked": ranked,
    }


def redis_shards(m: Dict[str, object]) -> int:
    """Shards a Redis Cluster needs for the index: the most of memory and the shared CPU."""
    s = m["shards"]
    return max(s["memory"], s["lookups + writes (one CPU)"])


# ====================================================================== measurements
def page_keys(chain: int, n: int) -> List[bytes]:
    return [hashlib.blake2b(f"fleet{chain}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def _lookup_client(conn) -> None:
    """A client process: on (url, chains, chain_pages, seconds) it times lookup_locations of random chains."""
    from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

    idx = None
    for msg in iter(conn.recv, None):
        url, chains, n, seconds, me = msg
        if idx is None:
            idx = RedisPrefixIndex(RedisIndexConfig(node_id=f"reader{me}", url=url, namespace="fleet",
                                                    lookup_timeout_s=2.0, node_ttl_s=30.0), serve=False)
        rng = random.Random(me)
        sample = [page_keys(c, n) for c in rng.sample(range(chains), min(chains, 256))]
        conn.send("ready")
        conn.recv()  # go
        calls = pages = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while True:
            keys = sample[calls % len(sample)]
            pages += len(idx.lookup_locations(keys[0], keys, NS))
            calls += 1
            if calls % 16 == 0 and time.perf_counter() >= end:
                break
        conn.send((calls, pages, time.perf_counter() - t0))
    if idx is not None:
        idx.close()


def _subscriber(conn) -> None:
    """A router's side: SUB on the endpoint it is sent, drains and decodes until the end marker."""
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    for endpoint in iter(conn.recv, None):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(endpoint)
        while True:  # the PUB sends probes until one arrives: no slow-joiner losses in the timing
            if sub.poll(50) and sub.recv_multipart()[1] == b"probe":
                break
        conn.send("ready")
        count = nbytes = 0
        t0 = None
        while True:
            _topic, seq, payload = sub.recv_multipart()
            if seq == b"probe":
                continue
            if seq == b"end":
                break
            if t0 is None:
                t0 = time.perf_counter()
            dec.decode(payload)
            count += 1
            nbytes += len(_topic) + len(seq) + len(payload)
        conn.send((count, nbytes, time.perf_counter() - (t0 or time.perf_counter())))
        sub.close(linger=0)
    ctx.term()


def server_cpu(r) -> float:
    """CPU seconds redis-server has used (user + system, main thread and others)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure_index(url: str, args, clients, bar) -> Dict[str, object]:
    import redis

    from radixtier.storage.api import PageLocation, PageRecord
    from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

    r = redis.Redis.from_url(url)
    n = args.chain_pages
    chains = max(1, args.records // n)
    records = chains * n
    idx = RedisPrefixIndex(RedisIndexConfig(node_id="n0", url=url, namespace="fleet", node_ttl_s=30.0,
                                            publish_queue=records + 1024, write_timeout_s=30.0))
    try:
        idx.flush(10)
        time.sleep(0.3)  # heartbeat and registry keys in place before the baseline
        r.execute_command("MEMORY PURGE")
        mem0, keys0 = r.info("memory")["used_memory"], r.dbsize()
        all_keys = [page_keys(c, n) for c in range(chains)]
        bar.set_description("index: publish")
        cpu0 = server_cpu(r)
        t0 = time.perf_counter()
        for c, keys in enumerate(all_keys):
            idx.publish(keys[0], keys, [PageRecord("n0", "storage", PageLocation(NS, c * n + i, 1, 1 << 20,
                                                                                 (c * n + i) * 2654435761 & 0xFFFFFFFF))
                                        for i in range(n)])
        if not idx.flush(600):
            raise RuntimeError("publish did not reach Redis (flush timed out)")
        pub_s = time.perf_counter() - t0
        pub_cpu = server_cpu(r) - cpu0
        dropped = idx.health().get("dropped_ops", 0)
        if dropped:
            raise RuntimeError(f"the publish queue dropped {dropped} records")
        mem1, keys1 = r.info("memory")["used_memory"], r.dbsize()
        bar.update(1)
        best = None
        runs = []
        for k in args.clients:
            bar.set_description(f"index: lookups, {k} client(s)")
            for i in range(k):
                clients[i].send((url, chains, n, args.lookup_seconds, i))
            for i in range(k):
                clients[i].recv()
            cpu0 = server_cpu(r)
            for i in range(k):
                clients[i].send("go")
            got = [clients[i].recv() for i in range(k)]
            cpu = server_cpu(r) - cpu0
            rate = sum(c / s for c, _p, s in got)
            pages = sum(p / s for _c, p, s in got)
            if any(p != c * n for c, p, _s in got):
                raise RuntimeError(f"lookups found fewer pages than published: {got}")
            calls = sum(c for c, _p, _s in got)
            runs.append({"clients": k, "lookups_per_s": rate, "pages_per_s": pages,
                         "server_cpu_share": cpu / max(s for _c, _p, s in got),
                         "server_bound_lookups_per_s": calls / cpu})
            if best is None or rate > best["lookups_per_s"]:
                best = runs[-1]
            bar.update(1)
        bar.set_description("index: unpublish")
        gone = all_keys[: max(1, chains // 4)]
        cpu0 = server_cpu(r)
        t0 = time.perf_counter()
        for keys in gone:
            idx.unpublish(keys)
        if not idx.flush(600):
            raise RuntimeError("unpublish did not reach Redis (flush timed out)")
        unpub_s = time.perf_counter() - t0
        unpub_cpu = server_cpu(r) - cpu0
        bar.update(1)
    finally:
        idx.close()
    return {"records": records, "chain_pages": n, "chains": chains,
            "bytes_per_record": (mem1 - mem0) / records, "keys_per_record": (keys1 - keys0) / records,
            "used_memory_before": mem0, "used_memory_after": mem1,
            "publish_records_per_s": records / pub_s,
            "unpublish_records_per_s": len(gone) * n / unpub_s,
            "server_bound_publish_records_per_s": records / pub_cpu,
            "server_bound_unpublish_records_per_s": len(gone) * n / unpub_cpu,
            "lookup_runs": runs, "lookups_per_s": best["lookups_per_s"],
            "server_bound_lookups_per_s": best["server_bound_lookups_per_s"],
            "lookup_pages_per_s": best["pages_per_s"], "lookup_best_clients": best["clients"]}


def _event(kind: str, blocks: int, tokens: int, rng: random.Random):
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch, StorageMedium

    hashes = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(blocks)]
    if kind == "removed":
        ev = BlockRemoved(block_hashes=hashes, medium=StorageMedium.DISK.value)
    else:
        ev = BlockStored(block_hashes=hashes, parent_block_hash=rng.randrange(-(1 << 63), 1 << 63),
                         token_ids=[rng.randrange(0, 150_000) for _ in range(blocks * tokens)], block_size=tokens,
                         lora_id=None, medium=StorageMedium.DISK.value)
    return KVEventBatch(ts=time.time(), events=[ev])


def wire_bytes(batch, enc) -> int:
    """What SGLang's ZmqEventPublisher sends for one batch: topic, 8-byte sequence, msgpack payload."""
    return len(TOPIC) + 8 + len(enc.encode(batch))


def measure_events(args, sub, tmp, bar) -> Dict[str, object]:
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, StorageMedium

    enc = msgspec.msgpack.Encoder()
    rng = random.Random(7)
    n, tok = args.chain_pages, args.page_tokens
    out: Dict[str, object] = {
        "stored_bytes": {1: wire_bytes(_event("stored", 1, 0, rng), enc), n: wire_bytes(_event("stored", n, 0, rng), enc)},
        "stored_bytes_tokens": {1: wire_bytes(_event("stored", 1, tok, rng), enc),
                                n: wire_bytes(_event("stored", n, tok, rng), enc)},
        "removed_bytes": {1: wire_bytes(_event("removed", 1, 0, rng), enc),
                          n: wire_bytes(_event("removed", n, 0, rng), enc)},
        "throughput": []}
    ctx = zmq.Context()
    blocks = int(args.new_pages_per_request)
    for label, tokens, count in (("tier-3 (no tokens)", 0, args.events), (f"with {tok} tokens/block", tok,
                                                                          max(1000, args.events // 4))):
        bar.set_description(f"events: {label}")
        endpoint = f"ipc://{tmp}/events-{tokens}.sock"
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(endpoint)
        sub.send(endpoint)
        while not sub.poll(0.02):
            pub.send_multipart((TOPIC, b"probe", b""))
        sub.recv()
        hashes = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(blocks * 64)]
        toks = [rng.randrange(0, 150_000) for _ in range(blocks * tokens)]
        t0 = time.perf_counter()
        for seq in range(count):
            h = hashes[(seq * blocks) % len(hashes):][:blocks] or hashes[:blocks]
            batch = KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=h, parent_block_hash=seq, token_ids=toks, block_size=tok, lora_id=None,
                medium=StorageMedium.DISK.value)])
            pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), enc.encode(batch)))
        pub_s = time.perf_counter() - t0
        pub.send_multipart((TOPIC, b"end", b""))
        got, nbytes, sub_s = sub.recv()
        pub.close(linger=1000)
        if got != count:
            raise RuntimeError(f"the subscriber got {got} of {count} events")
        out["throughput"].append({"what": label, "blocks_per_event": blocks, "events": count,
                                  "publish_events_per_s": count / pub_s, "publish_mb_per_s": nbytes / pub_s / 1e6,
                                  "subscriber_events_per_s": got / max(sub_s, 1e-9),
                                  "subscriber_mb_per_s": nbytes / max(sub_s, 1e-9) / 1e6,
                                  "bytes_per_event": nbytes / count})
        bar.update(1)
    ctx.term()
    # a router keeps up with the slower of its own decode rate and what it is sent: the tier-3 run's
    t = out["throughput"][0]
    out["subscriber_events_per_s"] = min(t["subscriber_events_per_s"], t["publish_events_per_s"])
    return out


# ====================================================================== report
def _si(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def render(res: Dict[str, object]) -> str:
    me, ev, m = res["measured"]["index"], res["measured"]["events"], res["model"]
    f = m["inputs"]
    n = me["chain_pages"]
    lines = [f"Measured on loopback ({res['host']}): {me['records']} records in {me['chains']} chains of {n} pages, "
             "one private redis-server", "",
             "| measured | value |", "|---|---:|",
             f"| Redis memory per page record | {me['bytes_per_record']:.0f} B |",
             f"| Redis keys per page record | {me['keys_per_record']:.2f} |",
             f"| publish (records/s, until flush) | {_si(me['publish_records_per_s'])} |",
             f"| unpublish (records/s, until flush) | {_si(me['unpublish_records_per_s'])} |"]
    for run in me["lookup_runs"]:
        lines.append(f"| {n}-page chain lookups/s, {run['clients']} client process(es) | {_si(run['lookups_per_s'])} "
                     f"({_si(run['pages_per_s'])} pages/s; server CPU {run['server_cpu_share']:.0%}) |")
    lines += [f"| per redis-server CPU-second: publish / unpublish records, {n}-page lookups | "
              f"{_si(me['server_bound_publish_records_per_s'])} / {_si(me['server_bound_unpublish_records_per_s'])} / "
              f"{_si(me['server_bound_lookups_per_s'])} |"]
    for k, label in (("stored_bytes", "BlockStored"), ("stored_bytes_tokens", f"BlockStored + {res['page_tokens']} tokens/block"),
                     ("removed_bytes", "BlockRemoved")):
        sizes = ev[k]
        lines.append(f"| {label} event on the wire, 1 / {n} blocks | {sizes['1']} / {sizes[str(n)]} B |")
    for t in ev["throughput"]:
        lines.append(f"| events of {t['blocks_per_event']} blocks, {t['what']}: encode+publish / SUB drain+decode | "
                     f"{_si(t['publish_events_per_s'])} / {_si(t['subscriber_events_per_s'])} events/s "
                     f"({t['publish_mb_per_s']:.1f} / {t['subscriber_mb_per_s']:.1f} MB/s) |")
    s = m["shards"]
    lines += ["", f"Fleet: {f['nodes']:.0f} nodes, {_si(f['pages'])} pages indexed, {_si(f['requests_per_s'])} "
              f"requests/s looking up {f['pages_per_request']:.0f} pages each, {f['new_pages_per_request']:.0f} new "
              f"pages per request ({_si(f['write_pages_per_s'])} pages/s stored, as many removed), shards of "
              f"{f['shard_memory_gib']:g} GiB ({f['usable_memory']:.0%} usable); shard rates: "
              + ("per redis-server CPU-second (--capacity server-cpu)" if res["capacity"] == "server-cpu"
                 else "as this machine's clients observed them (--capacity observed)"), "",
              "| extrapolated | fleet needs | one shard / subscriber gives | load (units) | shards / subscribers |",
              "|---|---:|---:|---:|---:|",
              f"| memory | {m['index_gib']:.1f} GiB | {m['usable_bytes_per_shard'] / GIB:.1f} GiB | "
              f"{m['loads']['memory']:.2f} | {s['memory']} |",
              f"| lookup rate | {_si(m['lookups_per_s'])} lookups/s ({_si(m['pages_looked_up_per_s'])} pages/s) | "
              f"{_si(m['lookup_capacity_per_shard'])} lookups/s | {m['loads']['lookup rate']:.2f} | {s['lookup rate']} |",
              f"| write rate | {_si(m['stores_per_s'])} + {_si(m['removals_per_s'])} records/s | "
              f"{_si(m['publish_capacity_per_shard'])} + {_si(m['unpublish_capacity_per_shard'])} records/s | "
              f"{m['loads']['write rate']:.2f} | {s['write rate']} |",
              f"| lookups + writes on one shard's CPU | | | "
              f"{m['loads']['lookup rate'] + m['loads']['write rate']:.2f} | {s['lookups + writes (one CPU)']} |",
              f"| event stream (one router) | {_si(m['events_per_s'])} events/s, "
              f"{m['event_bytes_per_s'] / 1e6:.2f} MB/s ({m['event_bytes_per_s_tokens'] / 1e6:.1f} MB/s with tokens) | "
              f"{_si(m['subscriber_events_per_s'])} events/s | {m['loads']['event stream']:.2f} | {m['subscribers']} |",
              "", "Conclusions:", ""]
    lines += [f"- {c}" for c in res["conclusions"]]
    lines += ["", "Assumptions:", ""] + [f"- {a}" for a in res["assumptions"]]
    return "\n".join(lines)


def conclusions(m: Dict[str, object]) -> List[str]:
    s = m["shards"]
    first = m["saturates_first"]
    order = ", ".join(f"{k} ({v:.2f})" for k, v in m["ranked"])
    out = [f"saturates first: {first}; loads in units of one shard/subscriber: {order}",
           f"index: {m['index_gib']:.1f} GiB of Redis for {_si(m['inputs']['pages'])} records "
           f"({_si(m['pages_per_node'])} per node) -> {s['memory']} shard(s) for memory",
           f"lookups: {_si(m['lookups_per_s'])}/s against {_si(m['lookup_capacity_per_shard'])}/s per shard -> "
           f"{s['lookup rate']} shard(s); writes: {s['write rate']} shard(s); both on one CPU: "
           f"{s['lookups + writes (one CPU)']} shard(s)",
           f"Redis Cluster: {redis_shards(m)} shard(s) cover memory, lookups and writes (chains spread by root; "
           "each lookup stays one MGET on one shard); sharding buys nothing for the event stream",
           f"event stream: {_si(m['events_per_s'])} events/s ({_si(m['events_per_s_per_node'])}/s per node, "
           f"{m['event_bytes_per_s'] / 1e6:.2f} MB/s) -> "
           + ("one router keeps up" if m["subscribers"] == 1 else
              f"one router cannot keep up: {m['subscribers']} routers (subscribers), each for a share of the nodes")]
    return out


ASSUMPTIONS = [
    "one holder per page: records = pages (a second holder adds a 96-byte entry to the page's value and an "
    "owned-hash field, less than a whole record)",
    "steady state: the fleet removes (unpublishes, BlockRemoved) as many pages as it stores",
    "one BlockStored per write call carrying its new pages, one BlockRemoved of as many blocks; tier-3 events "
    "carry no token ids (the with-tokens figure is SGLang's own GPU/CPU event format)",
    "a lookup's cost is per call up to the measured chain length, in proportion to pages beyond it; the lookup "
    "knows its chain's root (else a GET of the root pointer first, on the first page's own slot)",
    "Redis Cluster: a chain's page records share the hash slot of {root}, so memory, lookups and writes spread "
    "over shards by chain root, evenly only when many roots are busy; one hot root (a shared system prompt) "
    "stays on one shard, which replicas serving reads help, not more shards",
    "loopback on this machine: client processes and redis-server share its CPUs; the observed rates are what one "
    "node's writer thread and a few Python clients reach (lower bounds), the per-CPU-second rates what a shard's "
    "single Redis thread gives a fleet of clients (the model's default); network RTT is absent (it lengthens each "
    "lookup, not the shard's rate, given enough concurrent clients)",
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    g = ap.add_argument_group("measurement")
    g.add_argument("--quick", action="store_true", help="a ~20 s run: fewer records, shorter timings")
    g.add_argument("--records", type=int, default=None, help="page records to publish (default 200000; --quick 40000)")
    g.add_argument("--chain-pages", type=int, default=64, help="pages per published and looked-up chain (default 64)")
    g.add_argument("--clients", default=None, help="client process counts for lookups, comma-separated (default 1,2,4)")
    g.add_argument("--lookup-seconds", type=float, default=None, help="seconds per lookup run (default 6; --quick 2)")
    g.add_argument("--page-tokens", type=int, default=64, help="tokens per block in the with-tokens events (default 64)")
    g.add_argument("--events", type=int, default=None, help="events per throughput run (default 200000; --quick 40000)")
    g = ap.add_argument_group("fleet (the model)")
    g.add_argument("--nodes", type=float, default=1000, help="nodes in the fleet (default 1000)")
    g.add_argument("--pages", type=float, default=100e6, help="pages indexed fleet-wide (default 100e6)")
    g.add_argument("--requests-per-s", type=float, default=10_000, help="requests/s fleet-wide (default 10000)")
    g.add_argument("--pages-per-request", type=float, default=32, help="chain pages each request looks up (default 32)")
    g.add_argument("--new-pages-per-request", type=float, default=8, help="pages each request stores (default 8)")
    g.add_argument("--write-pages-per-s", type=float, default=None,
                   help="pages stored/s fleet-wide (default: requests-per-s x new-pages-per-request)")
    g.add_argument("--shard-memory-gib", type=float, default=64, help="memory of one Redis shard, GiB (default 64)")
    g.add_argument("--usable-memory", type=float, default=0.75,
                   help="fraction of a shard's memory for data (fragmentation, replication, fork; default 0.75)")
    g.add_argument("--capacity", choices=("server-cpu", "observed"), default="server-cpu",
                   help="a shard's rates for the model: operations per CPU-second of redis-server (what a shard "
                        "gives a fleet of clients; default) or the rates this machine's few clients observed")
    ap.add_argument("--out", default="bench/results/fleet_model.json", help="JSON; the .md goes beside it")
    a = ap.parse_args(argv)
    inputs = {k: getattr(a, k) for k in ("nodes", "pages", "requests_per_s", "pages_per_request",
                                         "new_pages_per_request", "write_pages_per_s", "shard_memory_gib",
                                         "usable_memory")}
    try:
        validate_inputs(inputs)  # refuse bad figures before minutes of measuring
        a.records = int(_positive("--records", a.records or (40_000 if a.quick else 200_000), True))
        a.events = int(_positive("--events", a.events or (40_000 if a.quick else 200_000), True))
        a.chain_pages = int(_positive("--chain-pages", a.chain_pages, True))
        a.page_tokens = int(_positive("--page-tokens", a.page_tokens, True))
        a.lookup_seconds = _positive("--lookup-seconds", a.lookup_seconds or (2.0 if a.quick else 6.0))
        a.clients = [int(_positive("--clients", c, True)) for c in (a.clients or ("1,2" if a.quick else "1,2,4")).split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    from tqdm import tqdm

    # helper processes first, before this process starts any thread (fork)
    ctx = multiprocessing.get_context("fork")
    clients, procs = [], []
    for i in range(max(a.clients)):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_lookup_client, args=(theirs,), name=f"lookup-client-{i}", daemon=True)
        p.start()
        clients.append(mine)
        procs.append(p)
    sub, theirs = ctx.Pipe()
    sp = ctx.Process(target=_subscriber, args=(theirs,), name="subscriber", daemon=True)
    sp.start()
    procs.append(sp)
    from radixtier.testing.redis_server import RedisServer

    tmp = tempfile.mkdtemp(prefix="radixtier-fleet-")
    srv = RedisServer(tmp)
    t_start = time.perf_counter()
    try:
        with tqdm(total=2 + len(a.clients) + 2, unit="step", file=sys.stderr) as bar:
            index = measure_index(srv.url, a, clients, bar)
            events = measure_events(a, sub, tmp, bar)
    finally:
        for c in clients:
            c.send(None)
        sub.send(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        srv.stop()
    measured = {**index, **{k: events[k] for k in ("stored_bytes", "stored_bytes_tokens", "removed_bytes",
                                                   "subscriber_events_per_s")}}
    if a.capacity == "server-cpu":  # what one shard's CPU gives when many nodes drive it
        for k in ("lookups_per_s", "publish_records_per_s", "unpublish_records_per_s"):
            measured[k] = index["server_bound_" + k]
    m = model(inputs, measured)
    res = {"host": f"{os.cpu_count()} CPUs, loopback", "quick": a.quick, "capacity": a.capacity, "page_tokens": a.page_tokens,
           "wall_s": time.perf_counter() - t_start,
           "measured": {"index": index, "events": json.loads(json.dumps(events))},
           "model": m, "conclusions": conclusions(m), "assumptions": ASSUMPTIONS}
    res = json.loads(json.dumps(res))  # int dict keys become strings, as in the file
    table = render(res)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {a.out}, {md} ({res['wall_s']:.0f} s of measuring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
