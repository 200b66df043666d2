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

from radixtier.integrations.sglang.events.kv_events import Tier3Events  # noqa: E402
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


def test_a_node_is_subscribed_once():
    with pytest.raises(ValueError, match="^sources: each node once"):
        PoolStream(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], f"tcp://*:{free_port()}")


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
