"""Tier-3 KV events read by a router nobody here wrote: Dynamo's standalone KV indexer
(`python -m dynamo.indexer`, ai-dynamo-runtime 1.6.1) subscribed over ZMQ to two workers' streams
in SGLang's wire format, asked over HTTP what each worker holds of a request's tokens (`/query`: leading tokens held per
worker in `gpu`, `cpu` and `disk`, each counting the tiers above it, and `longest_matched`).

Worker 1 publishes through radixtier's publisher with a radixtier backend attached (tier 3 joined);
worker 2 publishes the same SGLang events through SGLang's own publisher, with no tier 3: what a
router sees today. The SGLang side is played by the test (the events SGLang's scheduler publishes:
device stores with tokens, AllBlocksCleared on a flush); tests/test_sglang_server.py runs the same
check against real SGLang servers."""

from __future__ import annotations

import atexit
import json
import time

import pytest

from radixtier.testing.skips import require_dynamo, require_sglang

require_sglang("sglang.srt.disaggregation.kv_events")
require_dynamo()

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockStored, EventPublisherFactory,  # noqa: E402
                                                 KVEventBatch, ZmqEventPublisher)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from radixtier.integrations.sglang.launch.plugin import register_event_publisher  # noqa: E402
from radixtier.testing.dynamo_indexer import DynamoIndexer, tokens_of  # noqa: E402
from radixtier.testing.redis_server import free_port  # noqa: E402
from radixtier.testing.sglang_pools import PAGE, attach, chain_keys, make_host_pool, slots  # noqa: E402

RADIXTIER, PLAIN = 1, 2


def tokens(seed: int, pages: int) -> list:
    return [seed * 100_000 + i for i in range(pages * PAGE)]


def device_stored(keys: list, toks: list) -> KVEventBatch:
    """SGLang's scheduler taking a chain of pages into its device tree."""
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[hash_str_to_int64(k) for k in keys], parent_block_hash=None, token_ids=list(toks),
        block_size=PAGE, lora_id=None, medium="GPU")])


@pytest.fixture
def fleet(tmp_path):
    register_event_publisher()
    p1, p2 = free_port(), free_port()
    backend = attach(make_host_pool("page_first"), {"path": str(tmp_path / "ns.img"), "capacity": "4MiB", "partitions": 1,
                                                    "node_id": "node-a"})
    radixtier = EventPublisherFactory.create(json.dumps({"publisher": "radixtier", "endpoint": f"tcp://*:{p1}"}))
    plain = ZmqEventPublisher(0, endpoint=f"tcp://*:{p2}")
    indexer = DynamoIndexer(str(tmp_path), PAGE, {RADIXTIER: f"tcp://127.0.0.1:{p1}",
                                                  PLAIN: f"tcp://127.0.0.1:{p2}"})
    try:
        yield backend, radixtier, plain, indexer
    except BaseException:
        print(indexer.log_tail())
        raise
    finally:
        indexer.stop()
        backend.close()
        radixtier.shutdown()
        plain.shutdown()
        atexit.unregister(plain.shutdown)  # SGLang's publisher registers it; a second call waits 1 s


def publish_until_seen(indexer, streams, batch, toks, timeout=30.0):
    """ZMQ subscribers join late: publish SGLang's device stores again until the indexer has them."""
    deadline = time.monotonic() + timeout
    while True:
        for stream in streams:
            stream.publish(batch)
        answer = indexer.query(toks)
        if all(tokens_of(answer, w, "gpu") == len(toks) for w in (RADIXTIER, PLAIN)) or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def test_dynamo_still_scores_a_flushed_worker_for_its_tier3_prefix_until_tier3_evicts_it(fleet):
    backend, radixtier, plain, indexer = fleet
    system = chain_keys(6, "system-prompt")
    toks = tokens(1, 6)
    seen = publish_until_seen(indexer, (radixtier, plain), device_stored(system, toks), toks)
    assert tokens_of(seen, RADIXTIER, "gpu") == tokens_of(seen, PLAIN, "gpu") == 6 * PAGE, seen
    # SGLang backs the prompt up to tier 3 (worker 1 only has one)
    assert backend.batch_set_v1(system, slots(0, 6), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
    answer = indexer.wait_for(toks, lambda a: tokens_of(a, RADIXTIER, "disk") == 6 * PAGE)
    assert tokens_of(answer, RADIXTIER, "disk") == 6 * PAGE, answer  # Dynamo's tiers add up: gpu <= cpu <= disk

    # /flush_cache on both workers: SGLang's AllBlocksCleared; then a probe proves both streams got past it
    for stream in (radixtier, plain):
        stream.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    probe, probe_toks = chain_keys(1, "probe"), tokens(2, 1)
    publish_until_seen(indexer, (radixtier, plain), device_stored(probe, probe_toks), probe_toks)
    after_flush = indexer.wait_for(toks, lambda a: tokens_of(a, RADIXTIER, "disk") == 6 * PAGE)
    print("dynamo /query after flush:", after_flush)
    assert tokens_of(after_flush, RADIXTIER, "gpu") == 0
    assert tokens_of(after_flush, RADIXTIER, "disk") == tokens_of(after_flush, RADIXTIER, "longest_matched") \
        == 6 * PAGE, after_flush
    assert tokens_of(after_flush, PLAIN, "longest_matched") == 0, after_flush  # without tier-3 events: forgotten

    # tier 3 fills with other prompts and evicts the system prompt: the router is told
    capacity = backend.store.capacity_pages
    for n in range(capacity // 16 + 1):
        other = chain_keys(16, f"other-{n}")
        assert all(backend.batch_set_v1(other, slots(0, 16), HiCacheStorageExtraInfo(prefix_keys=[])))
    after_evict = indexer.wait_for(toks, lambda a: tokens_of(a, RADIXTIER, "disk") < 6 * PAGE)
    print("dynamo /query after tier-3 eviction:", after_evict)
    assert tokens_of(after_evict, RADIXTIER, "disk") < 6 * PAGE, after_evict
    assert backend.radixtier_stats()["kv_events"]["blocks_removed"] >= 1
