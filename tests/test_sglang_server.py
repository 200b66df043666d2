"""radixtier through SGLang's real server: `sglang.launch_server` processes over their HTTP API.

What users run: the server process, a scheduler process per rank, the detokenizer, the plugin entry
point in each, SGLang's logging and metrics. The toy model (random weights, a byte-level tokenizer)
runs on the CPU through radixtier's CPU support layer. Greedy outputs are compared with the same
server without an L3 backend: output tokens equal, per-token logprobs within LOGPROB_TOL (prefix
KV loaded from tier 3 holds the same bytes SGLang computed, so in practice they are identical).

Servers are started once per module and shared by the cases that prove the same thing; a server is
started only while no other is busy (an idle SGLang scheduler spins a core, and these machines have two).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from typing import Iterator

import pytest
import requests

from radixtier.testing.skips import require_sglang

require_sglang("uvicorn")
require_sglang("sglang.srt.mem_cache.hicache_storage")

from radixtier.demo import http_load  # noqa: E402
from radixtier.demo.hf_model import write_model  # noqa: E402
from radixtier.integrations.sglang.launch.plugin import backend_extra_config  # noqa: E402
from radixtier.integrations.sglang.launch.cpu_support import cuda_present  # noqa: E402
from radixtier.integrations.sglang.launch.server import (SGLangServer, ServerStartError, hicache_args,  # noqa: E402
                                                  radixtier_args, start_together)
from radixtier.native_dtype import resolve_dtype  # noqa: E402
from radixtier.storage.nvmeof.inspect import inspect_namespace  # noqa: E402
from radixtier.testing.server_checks import (LOGPROB_TOL, explained, metric, passes, same_outputs,  # noqa: E402
                                             storage_tokens, wait_for_backups)

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_server]

DEVICE = "cuda" if cuda_present() else "cpu"
# KV bytes per token relative to bf16: the toy computes in fp32 where the CPU has no native bf16
KV_SCALE = 2 if DEVICE == "cpu" and resolve_dtype("auto")[0] == "float32" else 1
CAPACITY = f"{256 * KV_SCALE}MiB"  # 8 partitions of 192 pages (12,288 tokens) in either dtype
# 64-token pages; a device pool of 6,144 tokens (about three of the chat's prompts) so SGLang evicts
# and write_back has something to write; metrics and per-tier cache reports on
COMMON = ["--page-size", "64", "--max-total-tokens", "6144", "--enable-cache-report", "--enable-metrics",
          "--log-level", "info"]
CHAT = http_load.multi_turn_chat(sessions=3, turns=3, system_chars=1500, user_chars=200, reply_chars=100, seed=11)
FRESH = http_load.multi_turn_chat(sessions=3, turns=2, system_chars=1200, user_chars=300, reply_chars=100, seed=23)
# one-off prompts of more tokens than the device holds: everything before them is evicted from it
FILLER = http_load.agent_fleet(agent_types=4, agents_per_type=1, steps=1, system_chars=2000, task_chars=100,
                               observation_chars=0, seed=31)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang-server")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(str(tmp_path_factory.getbasetemp() / "toy-llama"))


def server(model, workdir, name: str, args, **kw) -> SGLangServer:
    return SGLangServer(model, COMMON + list(args), log_path=str(workdir / f"{name}.log"), device=DEVICE, **kw)


def wait_for_index(redis_url: str, node: str, at_least: float, timeout_s: float = 30) -> None:
    """Until the prefix index names at least `at_least` pages of `node` (its publish queue runs after
    each backup, on a thread of its own: a busy machine can hold it back a while)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    deadline, n = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        n = sum(r.hlen(k) for k in r.scan_iter(match=f"*{{o:{node}*}}"))  # what the node published
        if n >= at_least:
            return
        time.sleep(0.1)
    raise AssertionError(f"the index names {n} pages of {node} after {timeout_s} s, expected >= {at_least}")


# ---------------------------------------------------------------- (e) a bad extra_config fails the launch
BAD_CONFIGS = [({"redis_ulr": "redis://127.0.0.1:1/0"}, "extra_config: unknown key 'redis_ulr'; did you mean 'redis_url'?"),
               ({"queue_depth": 0}, "queue_depth: expected")]


def test_bad_extra_config_fails_the_launch_in_seconds_and_creates_nothing(model, workdir):
    """Each bad extra_config is its own launch; the launches run at once (each is SGLang's imports)."""
    import threading

    launches = []
    for bad, message in BAD_CONFIGS:
        name = f"bad-{next(iter(bad))}"
        ns = workdir / name / "ns.img"
        extra = backend_extra_config(path=str(ns), capacity="64MiB", **bad)
        launches.append({"server": server(model, workdir, name, hicache_args(extra_config=extra, device=DEVICE)),
                         "ns": ns, "message": message})

    def launch(entry: dict) -> None:
        t0 = time.monotonic()
        try:
            entry["server"].start()
            entry["error"] = None
        except ServerStartError as exc:
            entry["error"] = str(exc)
        finally:
            entry["took"] = time.monotonic() - t0
            entry["server"].stop()

    threads = [threading.Thread(target=launch, args=(e,)) for e in launches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in launches:
        assert e["error"] is not None and e["message"] in e["error"], e.get("error")
        assert e["took"] < 60, f"the launch took {e['took']:.0f} s to fail"  # SGLang's own imports are most of it
        assert not e["ns"].exists() and not e["ns"].parent.exists()


# ---------------------------------------------------------------- (a) (d) (f) one node, the embedded default
@pytest.fixture(scope="module")
def reference_and_node_a(model, workdir):
    """The reference server (no L3) and TestOneNode's radixtier server, started together (a start-up
    is mostly imports, which two cores share better than one uses them); node A waits paused while
    the reference serves (and until its cases run), and the reference stops once its outputs are recorded."""
    ref = server(model, workdir, "reference", hicache_args(extra_config=None, backend="", device=DEVICE))
    ns = str(workdir / "a" / "ns.img")
    a = server(model, workdir, "node-a", radixtier_args(ns, capacity=CAPACITY, device=DEVICE))
    start_together([ref, a])
    try:
        a.pause()
        with explained(ref):
            out = passes(ref, CHAT)
            out["fresh"] = http_load.replay(ref.url, FRESH)
        ref.stop()
        yield out, (a, ns)  # A stays paused until TestOneNode's cases run (node_a)
    finally:
        ref.stop()
        a.stop()


@pytest.fixture(scope="module")
def reference(reference_and_node_a):
    """The same server without an L3 backend (L1 + L2 only): every prompt after a flush is recomputed."""
    return reference_and_node_a[0]


@pytest.fixture(scope="class")
def node_a(reference_and_node_a):
    """One server for TestOneNode's cases, stopped after the last (an idle scheduler spins a core)."""
    a, ns = reference_and_node_a[1]
    a.resume()
    yield a, ns
    a.stop()


class TestOneNode:
    """Cases that share one radixtier server on the embedded default (each stores what it reads)."""

    def test_chat_after_flush_comes_from_tier3_with_the_same_outputs(self, node_a, reference):
        """After a restart: the kill -9 case below restarts this server on the same namespace (what
        SIGTERM leaves is the same to the backend: SGLang never closes it), and the demo's case
        restarts one gracefully; both check tier-3 hits and outputs after it."""
        s, ns = node_a
        with explained(s):
            runs = passes(s, CHAT)
            same_outputs(reference["cold"], runs["cold"])
            assert storage_tokens(runs["cold"]) == 0
            assert [r.prompt_tokens for r in runs["cold"].replies] == \
                [http_load.prompt_tokens(t) for c in CHAT for t in c.turns]  # the toy's token count is exact
            first = runs["flushed"].replies[0]
            assert first.cached.get("storage", 0) >= 1024, f"first turn after the flush: {first.cached}"
            same_outputs(reference["flushed"], runs["flushed"])

    def test_radixtier_metrics_move_on_sglangs_metrics_endpoint(self, node_a):
        s, _ns = node_a
        with explained(s):
            http_load.replay(s.url, CHAT[:1])  # in tier 3 from here on, whichever case ran before
            wait_for_backups(s)
            before = s.metrics()
            assert metric(before, "radixtier:storage_capacity_pages") > 0
            written = metric(before, "radixtier:storage_written_pages_total")
            read = metric(before, "radixtier:storage_read_pages_total")
            s.flush_cache()
            http_load.replay(s.url, CHAT[:1])
            http_load.replay(s.url, FRESH[:1])
            wait_for_backups(s)
            after = s.metrics()
            assert metric(after, "radixtier:storage_read_pages_total") > read
            assert metric(after, "radixtier:storage_written_pages_total") > written
            assert metric(after, "radixtier:storage_read_seconds_count") > 0
            assert re.search(r"^sglang:", after, re.M)  # SGLang's own metrics are on the same page

    def test_kill_9_during_backups_then_restart_verifies_and_serves(self, node_a, reference):
        s, ns = node_a
        with explained(s):
            http_load.replay(s.url, CHAT[:1])  # in tier 3 before the crash, whichever case ran before
            wait_for_backups(s)
            s.flush_cache()
            seen = []

            def kill_after_two(reply):
                seen.append(reply)
                if len(seen) == 2:
                    s.kill()  # the write-through backups of the replies so far are in flight or just done

            with pytest.raises((requests.RequestException, RuntimeError)):
                http_load.replay(s.url, FRESH, concurrency=3, on_reply=kill_after_two)
            report = inspect_namespace(ns, verify=True)
            assert report["verified"] and report["errors"] == [], report["errors"][:5]
            s.start()  # same namespace: what tier 3 holds survives the process
            again = http_load.replay(s.url, CHAT)
            assert again.replies[0].cached.get("storage", 0) >= 1024, "tier-3 hits did not resume after the crash"
            same_outputs(reference["flushed"], again)
            fresh = http_load.replay(s.url, FRESH)
            same_outputs(reference["fresh"], fresh)


# ---------------------------------------------------------------- (b) the other host layout and write policy
def test_layer_first_write_back_serves_from_tier3_with_the_same_outputs(model, workdir, reference):
    """write_back copies KV down only when a tier evicts it: FILLER after CHAT evicts all of CHAT."""
    ns = str(workdir / "lf" / "ns.img")
    args = radixtier_args(ns, capacity=CAPACITY, layout="layer_first", write_policy="write_back", device=DEVICE)
    with server(model, workdir, "layer-first", args) as s, explained(s):
        cold = http_load.replay(s.url, CHAT)
        same_outputs(reference["cold"], cold)
        http_load.replay(s.url, FILLER)
        s.flush_cache()
        flushed = http_load.replay(s.url, CHAT)
        assert storage_tokens(flushed) > 0
        same_outputs(reference["flushed"], flushed)


# ---------------------------------------------------------------- (c) two nodes, one namespace, Redis
@pytest.fixture(scope="class")
def pair(model, workdir, reference):
    """Two radixtier servers on one namespace and a private redis-server, both alive (the index
    trusts only live nodes' records), for the two-node cases. A publishes KV events through
    radixtier's publisher (tier 3 joined to SGLang's stream), B through SGLang's own. Each partition
    holds 64 pages (4,096 tokens), so a few long prompts make A's tier 3 evict. Stopped after
    TestTwoNodes' last case (an idle scheduler spins a core)."""
    from radixtier.testing.redis_server import RedisServer, free_port

    redis = RedisServer(str(workdir / "pair-redis"))
    ns = str(workdir / "shared" / "ns.img")
    capacity = f"{20 * KV_SCALE}MiB"
    pa, pb, pa_replay = free_port(), free_port(), free_port()
    common = dict(redis_url=redis.url, device=DEVICE, capacity=capacity, partitions=2)
    a = server(model, workdir, "pair-a", radixtier_args(ns, node_id="node-a", partition=0, **common)
               + ["--kv-events-config", json.dumps({"publisher": "radixtier", "endpoint": f"tcp://*:{pa}",
                                                     "replay_endpoint": f"tcp://*:{pa_replay}"})])
    b = server(model, workdir, "pair-b", radixtier_args(ns, node_id="node-b", partition=1, **common)
               + ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{pb}"})])
    try:
        start_together([a, b])
        yield {"a": a, "b": b, "events_a": f"tcp://127.0.0.1:{pa}", "events_b": f"tcp://127.0.0.1:{pb}", "ns": ns,
               "replay_a": f"tcp://127.0.0.1:{pa_replay}", "redis_url": redis.url}
    finally:
        a.stop()
        b.stop()
        redis.stop()


class TestTwoNodes:
    """Cases that share two radixtier servers on one namespace and Redis (the `pair` fixture)."""

    def test_a_conversation_begun_on_one_node_continues_on_another_from_its_pages(self, pair, reference):
        a, b = pair["a"], pair["b"]
        with explained(a, b):
            begun = http_load.Conversation("chat-0", CHAT[0].turns[:2])
            first = http_load.replay(a.url, [begun])
            held = wait_for_backups(a, at_least=20)
            wait_for_index(pair["redis_url"], "node-a", held)  # B finds A's pages through the index
            # the user's third turn reaches B: its prompt is the first two turns and more
            cont = http_load.replay(b.url, [http_load.Conversation("chat-0", CHAT[0].turns[2:], first_turn=2)])
            reply = cont.replies[0]
            assert reply.cached.get("storage", 0) >= 1024, f"B's cached tokens for the third turn: {reply.cached}"
            assert metric(b.metrics(), "radixtier:remote_pages_read_total", node="node-b") >= 16
            same_outputs(reference["cold"], cont)
            assert http_load.compare(reference["cold"], first, LOGPROB_TOL) == []

    def test_dynamos_indexer_keeps_a_flushed_server_for_its_tier3_prefix_until_tier3_evicts(self, pair, workdir):
        """Two real servers, one namespace and Redis, both on radixtier; Dynamo's standalone KV indexer
        subscribed to both. A publishes through radixtier's publisher (tier 3 joined to SGLang's stream),
        B through SGLang's own: after both flush their device and host, Dynamo still scores A for the
        prompt it holds in tier 3 and has forgotten B (which could load it from tier 3 too, through the
        shared namespace); once A's tier 3 evicts the prompt, A's score drops."""
        from radixtier.testing.dynamo_indexer import DynamoIndexer, tokens_of
        from radixtier.testing.skips import require_dynamo

        require_dynamo()
        a, b = pair["a"], pair["b"]
        with explained(a, b), capture(pair["events_a"]) as stream_a:
            indexer = DynamoIndexer(str(workdir), 64, {1: pair["events_a"], 2: pair["events_b"]})
            try:
                prompt = token_ids(1, 1500)
                whole = len(prompt) // 64 * 64  # SGLang caches whole pages
                for attempt in range(5):  # a subscriber joins a PUB socket late: ask until both are seen
                    generate(a, prompt)
                    generate(b, prompt)
                    seen = indexer.wait_for(prompt, lambda q: all(tokens_of(q, w, "gpu") >= whole for w in (1, 2)), 10)
                    if all(tokens_of(seen, w, "gpu") >= whole for w in (1, 2)):
                        break
                assert all(tokens_of(seen, w, "gpu") >= whole for w in (1, 2)), seen
                wait_for_backups(a, at_least=whole // 64)
                a.flush_cache()
                b.flush_cache()
                # A's stream tells the flush (device gone) and its tier 3 (kept) as separate events, B's
                # the flush: wait until Dynamo has applied all three, not only the first to arrive
                after_flush = indexer.wait_for(prompt, lambda q: tokens_of(q, 1, "disk") >= whole and
                                               tokens_of(q, 1, "gpu") == 0 and 2 not in q)
                print("dynamo /query after flush:", after_flush)
                assert tokens_of(after_flush, 1, "gpu") == 0 and tokens_of(after_flush, 1, "disk") >= whole, after_flush
                assert tokens_of(after_flush, 2, "longest_matched") == 0, after_flush  # SGLang's own events: forgotten
                for n in range(3):  # 3 x 2,000 tokens through A: its partition (4,096 tokens) evicts the prompt
                    generate(a, token_ids(100 + n, 2000))
                after_evict = indexer.wait_for(prompt, lambda q: tokens_of(q, 1, "disk") < whole, 60)
                print("dynamo /query after A's tier 3 evicted:", after_evict)
                assert tokens_of(after_evict, 1, "disk") < whole, after_evict
                # one stream: SGLang's device events and tier 3's, the latter with the tokens SGLang gave
                from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

                events = [e for batch in stream_a for e in batch.events]
                device = {h: e.token_ids[i * 64:(i + 1) * 64] for e in events if isinstance(e, BlockStored)
                          and e.medium == "GPU" for i, h in enumerate(e.block_hashes)}
                disk = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
                assert disk and all(e.token_ids for e in disk)
                checked = 0
                for e in disk:  # a flush re-announces all of tier 3: earlier cases' pages have no GPU event here
                    for i, h in enumerate(e.block_hashes):
                        if h in device:
                            assert e.token_ids[i * 64:(i + 1) * 64] == device[h]
                            checked += 1
                assert checked >= whole // 64, f"{checked} tier-3 blocks matched to SGLang's own events"
                assert any(isinstance(e, BlockRemoved) and e.medium == "DISK" for e in events)
                print("A's stream, decoded (the first event of each kind and medium):")
                shown = set()
                for e in events:
                    medium = e.medium if isinstance(e, (BlockStored, BlockRemoved)) else None
                    if (type(e), medium) in shown:
                        continue
                    shown.add((type(e), medium))
                    line = f"  {type(e).__name__}"
                    if medium:
                        line += f" medium={medium} blocks={len(e.block_hashes)} first={e.block_hashes[0]}"
                    if isinstance(e, BlockStored):
                        line += (f" parent={e.parent_block_hash} block_size={e.block_size} tokens={len(e.token_ids)}"
                                 f" {e.token_ids[:6]}...")
                    print(line)
            except BaseException:
                print(indexer.log_tail())
                raise
            finally:
                indexer.stop()


    def test_a_worker_killed_and_restarted_is_scored_for_its_tier3_before_any_request(self, pair, workdir):
        """A is kill -9ed with a prompt in tier 3 and restarted on the same namespace. A router that
        lost the worker (a fresh Dynamo indexer, A registered again once it is up, as Dynamo's
        discovery does, with A's replay endpoint) and a pool-events process started after the writes
        (reading the partitions from the namespace) both score A's prompt -- Dynamo's `disk` for A
        and for the pool -- before any new request reaches A; once A's tier 3 evicts it, A's drops."""
        from radixtier.fleet.pool_stream import PoolStream
        from radixtier.testing.dynamo_indexer import DynamoIndexer, tokens_of
        from radixtier.testing.redis_server import free_port
        from radixtier.testing.skips import require_dynamo

        require_dynamo()
        a = pair["a"]
        prompt = token_ids(7, 1500)
        whole = len(prompt) // 64 * 64
        with explained(a):
            generate(a, prompt)
            wait_for_backups(a, at_least=whole // 64)
            a.kill()  # the prompt's pages are in A's partition; a router drops a worker it lost
            pool_port = free_port()
            indexer = DynamoIndexer(str(workdir), 64, {99: f"tcp://127.0.0.1:{pool_port}"})
            pool = None
            try:
                before = indexer.query(prompt)
                print("dynamo /query, A down:", before)
                assert tokens_of(before, 1, "longest_matched") == 0, before
                pool = PoolStream([pair["events_a"], pair["events_b"]], f"tcp://*:{pool_port}", namespace=pair["ns"],
                                  partitions=[0, 1])  # started after the writes: it reads the partitions
                print("pool-events read from the namespace at start:", pool.stats()["read_from_namespace"], "pages")
                in_pool = indexer.wait_for(prompt, lambda q: tokens_of(q, 99, "disk") >= whole, 30)
                print("dynamo /query, the pool started after the writes:", in_pool)
                assert tokens_of(in_pool, 99, "disk") >= whole, in_pool
                a.start()  # same namespace and ports; no request reaches it before the query below
                indexer.register(1, pair["events_a"], pair["replay_a"], 64)
                restarted = indexer.wait_for(prompt, lambda q: tokens_of(q, 1, "disk") >= whole, 30)
                print("dynamo /query after A's restart, before any request:", restarted)
                assert tokens_of(restarted, 1, "disk") >= whole and tokens_of(restarted, 1, "gpu") == 0, restarted
                assert tokens_of(restarted, 99, "disk") >= whole, restarted  # the pool: any node can load it
                for n in range(3):  # 3 x 2,000 tokens through A: its partition (4,096 tokens) evicts the prompt
                    generate(a, token_ids(300 + n, 2000))
                evicted = indexer.wait_for(prompt, lambda q: tokens_of(q, 1, "disk") < whole, 60)
                print("dynamo /query after A's tier 3 evicted:", evicted)
                assert tokens_of(evicted, 1, "disk") < whole, evicted
            except BaseException:
                print(indexer.log_tail())
                raise
            finally:
                indexer.stop()
                if pool is not None:
                    pool.close()


# ---------------------------------------------------------------- (g) tensor parallel: a partition per rank
def test_tp2_ranks_write_their_own_partitions_and_serve_from_them(model, workdir):
    if DEVICE == "cuda":
        pytest.skip("TP=2 needs two GPUs; on the CPU each rank gets a core")
    ns = str(workdir / "tp2" / "ns.img")
    s = server(model, workdir, "tp2", ["--tp-size", "2"] + radixtier_args(ns, capacity=CAPACITY, device=DEVICE),
               env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    with s, explained(s):
        runs = passes(s, CHAT[:2])
        assert storage_tokens(runs["flushed"]) > 0
        # TP=2 sums its all-reduce in another order than TP=1: compared with its own cold pass
        same_outputs(runs["cold"], runs["flushed"])
        used = {p["partition"]: p["used"] for p in inspect_namespace(ns)["partitions"]}
        assert used[0] > 0 and used[1] > 0 and used[0] == used[1], used
        owners = json.dumps(inspect_namespace(ns)["partitions"][:2])
        assert "node-a.r0" in owners and "node-a.r1" in owners


# ---------------------------------------------------------------- the README's first command
def test_the_demo_runs_sglangs_server_and_reports_tier3_reuse(tmp_path):
    import signal
    import subprocess
    import sys

    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    demo = subprocess.Popen([sys.executable, "-m", "radixtier", "demo", "--quick", "--json", str(out), "--png",
                             str(png), "--device", DEVICE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = demo.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGTERM)  # the demo stops its servers (their own process groups) on SIGTERM
        stdout, stderr = demo.communicate(timeout=60)
        pytest.fail(f"the demo ran past 900 s\n{stdout[-3000:]}{stderr[-3000:]}")
    assert demo.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "after restart: radixtier TTFT p50" in stdout and "greedy answers identical" in stdout
    assert png.stat().st_size > 10_000
    report = json.loads(out.read_text())
    assert report["all_identical"]
    assert stdout.startswith(f"radixtier demo: SGLang's real server") and f"computing in {report['dtype']}" in stdout
    for phases in report["workloads"].values():
        assert phases["first visit"]["radixtier"]["storage_tokens"] == 0
        for path in ("radixtier", "recompute"):  # SGLang's host tier serves users back after other traffic
            assert phases["after other traffic"][path]["host_share"] > 0.3, phases["after other traffic"][path]
            assert phases["after other traffic"][path]["storage_tokens"] == 0
        for phase in ("after flush", "after restart"):
            assert phases[phase]["radixtier"]["storage_share"] > 0.3, phases[phase]["radixtier"]
            assert phases[phase]["radixtier"]["host_tokens"] == 0
            assert phases[phase]["recompute"]["storage_tokens"] == 0


# ---------------------------------------------------------------- issue 30: a router sees tier 3
def generate(s: SGLangServer, input_ids: list) -> None:
    """A request by token ids (SGLang's native /generate), so the router can be asked about the same ids."""
    r = requests.post(f"{s.url}/generate", json={"input_ids": input_ids,
                                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                      timeout=300)
    r.raise_for_status()


def token_ids(seed: int, n: int) -> list:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 90) for _ in range(n)]  # the toy's vocabulary is 100 ids


@contextlib.contextmanager
def capture(endpoint: str) -> Iterator[list]:
    """Every batch published on `endpoint` while the block runs, decoded with SGLang's own types."""
    import threading

    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    batches: list = []
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder, stop = msgspec.msgpack.Decoder(KVEventBatch), threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if sub.poll(100):
                batches.append(decoder.decode(sub.recv_multipart()[-1]))
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield batches
    finally:
        stop.set()
        thread.join(5)
        sub.close()


