"""The shared pool's stream (radixtier/fleet/pool_stream.py, `radixtier pool-events`): what it
makes of the nodes' tier-3 events, and Dynamo's indexer reading it as one more source."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.disaggregation.kv_events")

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                                                 EventPublisherFactory, KVEventBatch)
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from radixtier.integrations.sglang.events.kv_events import EventsConfig, Tier3Events  # noqa: E402
from radixtier.integrations.sglang.launch.plugin import register_event_publisher  # noqa: E402
from radixtier.fleet.pool_stream import PoolStream  # noqa: E402
from radixtier.testing.redis_server import free_port  # noqa: E402
from radixtier.testing.sglang_pools import chain_keys  # noqa: E402

BS = 4


def probe_toks(n: int) -> list:
    return [900_000 + n * BS + i for i in range(BS)]


def stored(hashes, parent, medium="DISK", tokens=True):
    toks = [t for h in hashes for t in [h * 10 + i for i in range(BS)]] if tokens else []
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=toks, block_size=BS,
                       lora_id=None, medium=medium)


@pytest.fixture
def pool():
    p = PoolStream([f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"], f"tcp://*:{free_port()}")
    yield p
    p.close()


def test_a_block_enters_the_pool_with_its_first_holder_and_leaves_with_its_last(pool):
    first = pool.apply(0, [stored([1, 2], None)])
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.medium) for e in first] == \
        [([1, 2], None, [10, 11, 12, 13, 20, 21, 22, 23], "EXTERNAL")]
    second = pool.apply(1, [stored([1, 2, 3], None)])  # only the block new to the pool, under its parent
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in second] == [([3], 2, [30, 31, 32, 33])]
    ignored = [stored([7], None, medium="GPU"), BlockRemoved(block_hashes=[1], medium="GPU"), AllBlocksCleared()]
    assert pool.apply(0, ignored) == []  # device and host events are not about the pool
    assert pool.apply(0, [BlockRemoved(block_hashes=[1, 2], medium="DISK")]) == []  # node 1 still holds them
    assert pool.apply(1, [BlockRemoved(block_hashes=[9], medium="DISK")]) == []  # never in the pool
    gone = pool.apply(1, [BlockRemoved(block_hashes=[1, 3], medium="DISK")])
    assert [(e.block_hashes, e.medium) for e in gone] == [([1, 3], "EXTERNAL")]
    assert pool.stats()["blocks_in_pool"] == 1  # block 2: node 1 still holds it


def test_a_block_without_tokens_waits_for_a_holder_that_has_them(pool):
    assert pool.apply(0, [stored([1], None, tokens=False)]) == []  # a router would ignore it
    later = pool.apply(1, [stored([1], None)])
    assert [(e.block_hashes, e.token_ids) for e in later] == [([1], [10, 11, 12, 13])]
    assert pool.stats()["without_tokens"] == 1


def test_a_node_that_restarted_takes_its_blocks_out_of_the_pool(pool):
    pool.apply(0, [stored([1, 2], None)], seq=0)
    pool.apply(1, [stored([2], None)], seq=0)
    pool.apply(0, [], seq=1)
    again = pool.apply(0, [stored([5], None)], seq=0)  # its sequence went back: it restarted
    assert [(type(e).__name__, e.block_hashes) for e in again] == [("BlockRemoved", [1]), ("BlockStored", [5])]
    assert pool.stats()["node_restarts"] == 1 and pool.stats()["blocks_in_pool"] == 2  # node 1 still holds 2


def test_a_restarted_node_read_back_from_its_partition_keeps_what_it_still_holds(pool):
    """With its partition read again (reseed), a restarted node's blocks that tier 3 still holds stay
    in the pool -- no removal, no second announcement -- and only what it lost leaves."""
    pool.apply(0, [stored([1, 2, 3], None)], seq=0)
    pool.apply(0, [], seq=1)
    again = pool.apply(0, [], seq=0, reseed=[stored([1, 2], None)])  # it restarted holding pages 1 and 2
    assert [(type(e).__name__, e.block_hashes) for e in again] == [("BlockRemoved", [3])]
    assert sorted(pool.holders()) == [1, 2] and pool.stats()["node_restarts"] == 1


def test_a_node_is_subscribed_once():
    with pytest.raises(ValueError, match="^sources: each node once"):
        PoolStream(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], f"tcp://*:{free_port()}")
    with pytest.raises(ValueError, match="^partitions: given without the namespace"):
        PoolStream(["tcp://127.0.0.1:1"], f"tcp://*:{free_port()}", partitions=[0])
    with pytest.raises(ValueError, match="^partitions: each partition once"):
        PoolStream(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], f"tcp://*:{free_port()}", namespace="/x",
                   partitions=[0, 0])


def test_past_its_bound_the_pool_counts_blocks_it_does_not_track():
    p = PoolStream([f"tcp://127.0.0.1:{free_port()}"], f"tcp://*:{free_port()}", max_blocks=2)
    try:
        out = p.apply(0, [stored([1, 2, 3], None)])
        assert [e.block_hashes for e in out] == [[1, 2]]
        assert p.stats()["untracked"] == 1
    finally:
        p.close()


def test_the_cli_refuses_a_bad_endpoint_by_name():
    out = subprocess.run([sys.executable, "-m", "radixtier", "pool-events", "--source", "node-a:5557",
                          "--endpoint", "tcp://*:5600"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ("radixtier pool-events: error: --source: expected a ZMQ endpoint such as "
                                  "tcp://host:5557, got 'node-a:5557'")
    out = subprocess.run([sys.executable, "-m", "radixtier", "pool-events", "--source", "0=tcp://node-a:5557",
                          "--endpoint", "tcp://*:5600"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (
        "radixtier pool-events: error: --source: PARTITION=ENDPOINT needs --namespace (the namespace those "
        "partitions are of)")


def test_dynamo_finds_a_prefix_in_the_pool_that_only_another_node_wrote(tmp_path):
    """Two nodes on one shared namespace, each publishing SGLang's stream with tier 3 joined; the pool
    stream subscribed to both; Dynamo's indexer subscribed to the nodes and the pool. Node 1 wrote a
    system prompt to tier 3 and flushed its device: Dynamo finds the prompt on node 1 (DISK) and in
    the pool (EXTERNAL: any attached node, node 2 included, can load it), not on node 2 itself."""
    from radixtier.testing.dynamo_indexer import DynamoIndexer, tokens_of
    from radixtier.testing.skips import require_dynamo

    require_dynamo()
    register_event_publisher()
    ports = [free_port() for _ in range(3)]
    nodes = [EventPublisherFactory.create(json.dumps({"publisher": "radixtier", "endpoint": f"tcp://*:{p}"}))
             for p in ports[:2]]
    tier3 = [Tier3Events.joined_to(n, BS) for n in nodes]
    pool = PoolStream([f"tcp://127.0.0.1:{p}" for p in ports[:2]], f"tcp://*:{ports[2]}")
    indexer = DynamoIndexer(str(tmp_path), BS, {1: f"tcp://127.0.0.1:{ports[0]}", 2: f"tcp://127.0.0.1:{ports[1]}",
                                                99: f"tcp://127.0.0.1:{ports[2]}"})
    try:
        keys = chain_keys(3, "system")
        h = [hash_str_to_int64(k) for k in keys]
        toks = [t for x in h for t in [x % 1000 * 10 + i for i in range(BS)]]
        device = KVEventBatch(ts=time.time(), events=[BlockStored(block_hashes=h, parent_block_hash=None,
                                                                   token_ids=toks, block_size=BS, lora_id=None,
                                                                   medium="GPU")])
        deadline = time.monotonic() + 30
        while tokens_of(indexer.query(toks), 1, "gpu") < len(toks) and time.monotonic() < deadline:
            nodes[0].publish(device)  # node 1 computes the prompt (published again until the SUBs joined)
            time.sleep(0.2)
        n = 0
        while tokens_of(indexer.query(probe_toks(n)), 99, "disk") == 0 and time.monotonic() < deadline:
            n += 1  # a new probe block each time: the pool announces a block once, and Dynamo may join late
            probe = chain_keys(1, f"probe-{n}")
            nodes[0].publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[hash_str_to_int64(probe[0])], parent_block_hash=None, token_ids=probe_toks(n),
                block_size=BS, lora_id=None, medium="GPU")]))
            tier3[0].stored(probe, None, [probe[0].encode()], [True])
            time.sleep(0.3)
        tier3[0].stored(keys, None, [k.encode() for k in keys], [True] * 3)  # the prompt's backup lands in tier 3
        nodes[0].publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))  # /flush_cache on node 1
        answer = indexer.wait_for(toks, lambda a: tokens_of(a, 99, "disk") == len(toks)
                                  and tokens_of(a, 1, "gpu") == 0 and tokens_of(a, 1, "disk") == len(toks))
        print("dynamo /query, node 1 flushed:", answer)
        assert tokens_of(answer, 99, "disk") == len(toks), answer  # the pool: any attached node can load it
        assert tokens_of(answer, 1, "gpu") == 0 and tokens_of(answer, 1, "disk") == len(toks), answer
        assert tokens_of(answer, 2, "longest_matched") == 0, answer
        assert '"storage_tier": "external"' in json.dumps(indexer.dump())
    except BaseException:
        print(indexer.log_tail())
        raise
    finally:
        indexer.stop()
        pool.close()
        for t in tier3:
            t.close()
        for n in nodes:
            n.shutdown()


def test_the_fleet_view_over_http_answers_per_node_and_refuses_hostile_input(pool):
    import urllib.error
    import urllib.request

    from radixtier.fleet.pool_http import serve

    pool.apply(0, [stored([1, 2, 3], None)])
    pool.apply(1, [stored([1], None)])
    port = free_port()
    http = serve(pool, f"127.0.0.1:{port}")
    try:
        def post(body: bytes):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/fleet_view", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read())

        code, view = post(json.dumps({"block_hashes": [1, 2, 3, 4]}).encode())
        src = pool.sources[0]
        assert code == 200 and view["pool"] == 3 and view["nodes"][src] == {"disk": 3, "external": 3}
        # node 1 wrote only the first block itself; it can load all three from the pool
        assert view["nodes"][pool.sources[1]] == {"disk": 1, "external": 3}
        for bad in (b"not json", b'{"block_hashes": "1,2"}', b'{"block_hashes": [1.5]}',
                    json.dumps({"block_hashes": [1 << 64]}).encode(), b"{}"):
            code, err = post(bad)
            assert code == 400 and err["error"].split(":")[0] in ("body", "block_hashes"), (bad, err)
    finally:
        http.shutdown()


def test_a_pool_started_after_the_writes_shows_the_pool_that_ran_throughout(tmp_path):
    """Two nodes write their partitions of one namespace (pages tagged as the SGLang backend tags
    them) and announce on their own streams. A pool process that listened from the start and one
    started after the writes -- reading what the partitions hold from the namespace -- end with the
    same pool once the nodes go on (one evicts, the other writes), and the late one announced, on
    its own stream, what it read."""
    import torch

    from radixtier.storage.nvmeof.store import NvmeofPageStore
    from radixtier.testing.kv_replay import events_of, replayed

    ns = str(tmp_path / "ns.img")
    stores = [NvmeofPageStore(ns, 4096, partition=p, partitions=2, node_id=f"node-{p}", create_bytes=16 << 20)
              for p in range(2)]
    ports = [free_port() for _ in range(4)]
    nodes = [Tier3Events.own_stream(EventsConfig(f"tcp://*:{ports[i]}", "", ""), BS) for i in range(2)]
    sources = [f"tcp://127.0.0.1:{ports[i]}" for i in range(2)]
    early = PoolStream(sources, f"tcp://*:{ports[2]}", namespace=ns, partitions=[0, 1])
    late = None

    def write(node: int, keys: list, parent=None):
        h = [hash_str_to_int64(k) for k in keys]
        toks = [x % 100_000 * BS + i for x in h for i in range(BS)]  # token ids as a vocabulary has them
        nodes[node].observed(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=h, parent_block_hash=None if parent is None else hash_str_to_int64(parent), token_ids=toks,
            block_size=BS, lora_id=None, medium="GPU")]))
        assert nodes[node].flush(10)
        tags = nodes[node].tags_for(keys, parent)
        sks = [bytes.fromhex(k)[:16] for k in keys]
        res = stores[node].put(sks, [torch.full((1024,), float(i)) for i in range(len(keys))],
                               [None] + sks[:-1], tags)
        nodes[node].stored(keys, parent, sks, res.ok)
        assert nodes[node].flush(10)

    try:
        def until_heard(pool: PoolStream) -> None:
            """Both nodes' streams reach `pool` (a SUB joins late): a probe page stored and removed."""
            deadline = time.monotonic() + 30
            while pool.stats()["nodes_heard"] < 2 and time.monotonic() < deadline:
                for n in nodes:
                    n.stored([chain_keys(1, "probe")[0]], None, [b"\xff" * 16], [True])
                    n.removed([b"\xff" * 16])
                    assert n.flush(10)
                time.sleep(0.05)
            assert pool.stats()["nodes_heard"] == 2

        until_heard(early)
        system = chain_keys(3, "shared-system-prompt")
        write(0, system)
        write(1, system)  # the same prompt in both partitions: two holders
        write(0, chain_keys(2, "a-only"), None)
        deadline = time.monotonic() + 20
        while len(early.holders()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        replay = f"tcp://127.0.0.1:{free_port()}"
        late = PoolStream(sources, f"tcp://*:{ports[3]}", replay_endpoint=replay.replace("127.0.0.1", "*"),
                          namespace=ns, partitions=[0, 1])
        assert late.stats()["read_from_namespace"] == 8
        said = [e for e in events_of(replayed(replay, 1)) if isinstance(e, BlockStored)]
        assert {e.medium for e in said} == {"EXTERNAL"}
        assert sorted(h for e in said for h in e.block_hashes) == sorted(
            hash_str_to_int64(k) for k in system + chain_keys(2, "a-only"))
        until_heard(late)
        gone = [bytes.fromhex(k)[:16] for k in system]
        assert stores[0].delete(gone) == 3
        nodes[0].removed(gone)  # node 0 evicts the prompt: node 1 still holds it
        write(1, chain_keys(2, "b-only"))
        for n in nodes:
            assert n.flush(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not len(late.holders()) == len(early.holders()) == 7:
            time.sleep(0.1)
        assert late.holders() == early.holders()
        view = early.holders()
        assert len(view) == 7 and all(announced for announced, _who in view.values())
        assert all(who == [sources[1]] for h, (_a, who) in view.items()
                   if h in {hash_str_to_int64(k) for k in system})
    finally:
        for p in (early, late):
            if p is not None:
                p.close()
        for n in nodes:
            n.close()
        for s in stores:
            s.close()
