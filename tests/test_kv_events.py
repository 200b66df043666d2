"""Tier-3 KV events (radixtier/integrations/sglang/events/kv_events.py): SGLang's own event classes and ZMQ
publisher, read back as a router would -- over ZMQ, decoded with SGLang's msgspec types."""

from __future__ import annotations

import json
import threading
import time

import pytest

from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.disaggregation.kv_events")

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                                                 KVEventBatch, ZmqEventPublisher)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError  # noqa: E402
from radixtier.integrations.sglang.events.kv_events import EventsConfig, Tier3Events  # noqa: E402
from radixtier.testing.kv_replay import events_of, replayed  # noqa: E402
from radixtier.testing.sglang_pools import attach, chain_keys, make_host_pool, slots  # noqa: E402

@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"


def test_events_say_what_tier_3_holds_in_sglangs_format(endpoints):
    pub, replay = endpoints
    ev = Tier3Events.own_stream(EventsConfig(pub, replay, "rt"), block_size=64)
    try:
        keys, parent = chain_keys(4, "a"), chain_keys(1, "p")[0]
        sks = [bytes([i]) * 16 for i in range(4)]
        ev.stored(keys, parent, sks, [True, True, False, True])  # a page that did not land breaks the run
        ev.removed([sks[1], b"\xee" * 16])  # one this process wrote, one it cannot name
        ev.cleared()
        got = events_of(replayed(replay, 3))
        h = [hash_str_to_int64(k) for k in keys]
        assert [type(e) for e in got] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
        first, second, removed = got[0], got[1], got[2]
        assert (first.block_hashes, first.parent_block_hash) == (h[:2], hash_str_to_int64(parent))
        assert (second.block_hashes, second.parent_block_hash) == ([h[3]], h[2])
        assert {first.medium, second.medium, removed.medium} == {"DISK"}
        assert (first.token_ids, first.block_size) == ([], 64)  # the backend never sees tokens: said, not faked
        assert removed.block_hashes == [h[1]]
        stats = ev.stats()
        assert (stats["blocks_stored"], stats["blocks_removed"], stats["removals_unnamed"], stats["cleared"]) == \
            (3, 1, 1, 1)
    finally:
        ev.close()


def test_a_stalled_publisher_never_blocks_a_transfer_thread(endpoints, monkeypatch):
    """The transfer thread appends to a bounded queue and goes on; past the bound, batches are
    dropped and counted, never waited for."""
    release = threading.Event()
    real = ZmqEventPublisher.publish
    monkeypatch.setattr(ZmqEventPublisher, "publish", lambda self, batch: (release.wait(10), real(self, batch)))
    pub, replay = endpoints
    ev = Tier3Events.own_stream(EventsConfig(pub, replay), block_size=64, queue_batches=2)
    try:
        keys = chain_keys(8, "b")
        t0 = time.monotonic()
        for i in range(8):
            ev.stored([keys[i]], None, [bytes([i]) * 16], [True])
        assert time.monotonic() - t0 < 0.5
        assert ev.stats()["dropped"] >= 5  # one in the publisher's hands, two queued, the rest dropped
        release.set()
    finally:
        release.set()
        ev.close()


def test_the_backend_announces_its_writes_evictions_and_clear(tmp_path, endpoints):
    """Through SGLang's storage interface: a backup's pages are announced with SGLang's hashes and
    parent links, and the events stop at close."""
    pub, replay = endpoints
    host = make_host_pool("page_first")
    ns = {"path": str(tmp_path / "ns.img"), "capacity": "64MiB", "node_id": "node-a",
          "kv_events_endpoint": pub, "kv_events_replay_endpoint": replay}
    b = attach(host, ns)
    try:
        keys = chain_keys(6, "c")
        assert b.batch_set_v1(keys[:3], slots(0, 3), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 3
        assert b.batch_set_v1(keys[3:], slots(3, 3), HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == [True] * 3
        assert b.clear()
        got = events_of(replayed(replay, 3))
        h = [hash_str_to_int64(k) for k in keys]
        assert isinstance(got[0], BlockStored) and got[0].block_hashes == h[:3] and got[0].parent_block_hash is None
        assert isinstance(got[1], BlockStored) and got[1].block_hashes == h[3:] and got[1].parent_block_hash == h[2]
        assert isinstance(got[-1], AllBlocksCleared)
        assert b.radixtier_stats()["kv_events"]["blocks_stored"] == 6
    finally:
        b.close()


def test_events_are_off_unless_an_endpoint_is_set_and_a_bad_one_is_refused_by_name():
    import subprocess
    import sys

    code = ("import sys, radixtier.integrations.sglang.backend.radixtier_storage\n"
            "print('radixtier.integrations.sglang.events.kv_events' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    for bad in ("5600", "http://x:1", "tcp:/x"):
        with pytest.raises(ConfigError, match=r"^kv_events_endpoint: expected a ZMQ endpoint"):
            BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_endpoint": bad})
    cfg = BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_endpoint": "tcp://*:5600"})
    assert (cfg.kv_events_endpoint, cfg.kv_events_topic) == ("tcp://*:5600", "radixtier")


# ---------------------------------------------------------------- joined to SGLang's own stream

PAGE_TOKENS = 16  # the test pools' page size (radixtier.testing.sglang_pools.PAGE)


def page_tokens(i: int) -> list:
    return [1000 + PAGE_TOKENS * i + j for j in range(PAGE_TOKENS)]


def gpu_stored(hashes: list, parent, pages: list) -> KVEventBatch:
    """What SGLang's scheduler publishes when its device tree takes pages (coalesced, as SGLang does)."""
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[t for p in pages for t in page_tokens(p)],
        block_size=PAGE_TOKENS, lora_id=None, medium="GPU")])


@pytest.fixture
def sglang_stream(endpoints):
    """radixtier's publisher as SGLang builds it from `--kv-events-config`; made by the test after
    the backend attached, as in SGLang's scheduler (tree cache first, publisher second)."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    from radixtier.integrations.sglang.launch.plugin import register_event_publisher

    register_event_publisher()
    pub, replay = endpoints
    made = []

    def make():
        made.append(EventPublisherFactory.create(json.dumps(
            {"publisher": "radixtier", "endpoint": pub, "replay_endpoint": replay, "topic": "kv"})))
        return made[-1]
    yield make
    for stream in made:
        stream.shutdown()


def test_tier3_joins_sglangs_stream_with_sglangs_tokens_and_survives_a_flush(tmp_path, endpoints, sglang_stream):
    """With SGLang's events on radixtier's publisher: tier-3 pages are announced in SGLang's own
    stream with the tokens SGLang announced for the same hashes (a page waits for them); after
    SGLang's AllBlocksCleared (a /flush_cache) what tier 3 holds is announced again; a backend
    clear() removes tier 3's pages (DISK) and never sends AllBlocksCleared."""
    _pub, replay = endpoints
    b = attach(make_host_pool("page_first"), {"path": str(tmp_path / "ns.img"), "capacity": "64MiB",
                                              "node_id": "node-a", "kv_events_token_wait_s": 60})
    try:
        assert "kv_events" not in b.radixtier_stats()  # nothing until SGLang builds the publisher
        stream = sglang_stream()
        keys = chain_keys(4, "j")
        h = [hash_str_to_int64(k) for k in keys]
        stream.publish(gpu_stored(h[:2], None, [0, 1]))
        replayed(replay, 1)
        assert b.batch_set_v1(keys, slots(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
        got = replayed(replay, 2)  # pages 0 and 1: their tokens are known
        stream.publish(gpu_stored(h[2:], h[1], [2, 3]))
        got = replayed(replay, 4)  # pages 2 and 3 waited for theirs
        stream.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        got = replayed(replay, 6)
        assert b.clear()
        got = replayed(replay, 7)
        disk = [(type(e).__name__, e.block_hashes, getattr(e, "parent_block_hash", None),
                 getattr(e, "token_ids", None)) for e in events_of(got) if getattr(e, "medium", None) == "DISK"]
        assert disk == [
            ("BlockStored", h[:2], None, page_tokens(0) + page_tokens(1)),
            ("BlockStored", h[2:], h[1], page_tokens(2) + page_tokens(3)),
            ("BlockStored", h, None, [t for p in range(4) for t in page_tokens(p)]),  # again, after the flush
            ("BlockRemoved", h, None, None)]
        assert sum(isinstance(e, AllBlocksCleared) for e in events_of(got)) == 1  # SGLang's own, not ours
        stats = b.radixtier_stats()["kv_events"]
        assert (stats["reannounced"], stats["stored_without_tokens"], stats["sglang_batches_seen"]) == (4, 0, 3)
    finally:
        b.close()


def test_a_page_whose_tokens_never_come_is_announced_without_them_and_counted(endpoints, sglang_stream):
    _pub, replay = endpoints
    stream = sglang_stream()
    ev = Tier3Events.joined_to(stream, block_size=PAGE_TOKENS, token_wait_s=0.2)
    try:
        keys = chain_keys(2, "w")
        ev.stored(keys, None, [b"\x01" * 16, b"\x02" * 16], [True, True])
        got = events_of(replayed(replay, 1))
        assert [(e.block_hashes, e.token_ids, e.medium) for e in got] == \
            [([hash_str_to_int64(k) for k in keys], [], "DISK")]
        assert ev.stats()["stored_without_tokens"] == 2
    finally:
        ev.close()


def test_a_page_stored_again_is_said_once_parents_come_first_and_a_removal_is_never_lost(endpoints, sglang_stream):
    """A page backed up again (a shared system prompt after a flush) is not announced again nor
    moved behind its children; evicted after it was announced, its removal is sent even when it
    was stored again meanwhile; a re-announce after SGLang's flush sends parents before children."""
    _pub, replay = endpoints
    stream = sglang_stream()
    ev = Tier3Events.joined_to(stream, block_size=PAGE_TOKENS, token_wait_s=60)
    try:
        keys = chain_keys(3, "o")
        h = [hash_str_to_int64(k) for k in keys]
        sks = [bytes([i]) * 16 for i in range(3)]
        ev.stored(keys[:2], None, sks[:2], [True, True])          # A -> B, waiting for tokens
        ev.stored(keys[:1], None, sks[:1], [True])                # A again
        stream.publish(gpu_stored(h[:2], None, [0, 1]))
        assert ev.flush(10)
        ev.stored(keys[1:], keys[0], sks[1:], [True, True])       # B again, then C (no tokens yet)
        ev.removed([sks[1]])                                      # B evicted while C waits
        stream.publish(gpu_stored(h[2:], h[1], [2]))
        stream.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        assert ev.flush(10)
        disk = [(type(e).__name__, e.block_hashes, getattr(e, "parent_block_hash", None))
                for e in events_of(replayed(replay, 7)) if getattr(e, "medium", None) == "DISK"]
        assert disk == [("BlockStored", h[:2], None), ("BlockRemoved", [h[1]], None), ("BlockStored", [h[2]], h[1]),
                        ("BlockStored", [h[0]], None), ("BlockStored", [h[2]], h[1])], disk
    finally:
        ev.close()


def test_closing_takes_no_time_and_removes_what_was_announced(endpoints, sglang_stream):
    _pub, replay = endpoints
    stream = sglang_stream()
    ev = Tier3Events.joined_to(stream, block_size=PAGE_TOKENS, token_wait_s=60)
    keys = chain_keys(2, "z")
    ev.stored(keys, None, [b"\x01" * 16, b"\x02" * 16], [True, True])
    stream.publish(gpu_stored([hash_str_to_int64(k) for k in keys], None, [0, 1]))
    assert ev.flush(10)
    t0 = time.monotonic()
    ev.close()
    assert time.monotonic() - t0 < 1.0
    got = [e for e in events_of(replayed(replay, 3)) if getattr(e, "medium", None) == "DISK"]
    assert [type(e).__name__ for e in got] == ["BlockStored", "BlockRemoved"]
    ev.stored(keys, None, [b"\x03" * 16] * 2, [True, True])  # after close: ignored, never blocks
    assert ev.stats()["queued"] == 0


def test_a_restarted_backend_announces_what_tier3_holds_before_any_request(tmp_path, endpoints, sglang_stream):
    """Pages written with their tags (SGLang's hashes, parent, tokens) are announced by the next
    backend opening the namespace, parents first, before it serves anything; a page whose tokens
    were unknown when written is announced with the tokens SGLang teaches later, or counted."""
    _pub, replay = endpoints
    extra = {"path": str(tmp_path / "ns.img"), "capacity": "64MiB", "node_id": "node-a", "kv_events_token_wait_s": 60}
    keys = chain_keys(5, "r")
    h = [hash_str_to_int64(k) for k in keys]
    b = attach(make_host_pool("page_first"), extra)
    stream = sglang_stream()
    try:
        stream.publish(gpu_stored(h[:4], None, [0, 1, 2, 3]))
        replayed(replay, 1)
        assert b.batch_set_v1(keys, slots(0, 5), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 5
        stream.publish(gpu_stored(h[4:], h[3], [4]))
        assert b._events.current.flush(10)
    finally:
        b.close()  # a joined stream removes what it announced: the router forgets this worker
        stream.shutdown()
    before = len(replayed(replay, 0, timeout=0))
    b = attach(make_host_pool("page_first"), extra)  # restarted on the same namespace
    stream = sglang_stream()
    try:
        assert b._events.current is not None
        assert b._events.current.flush(10)
        got = events_of(replayed(replay, before + 1))
        disk = [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in got
                if isinstance(e, BlockStored) and e.medium == "DISK"]
        assert disk == [(h[:4], None, [t for p in range(4) for t in page_tokens(p)]), ([h[4]], h[3], [])]
        stats = b.radixtier_stats()["kv_events"]
        assert (stats["held_announced"], stats["stored_without_tokens"], stats["held_announcements"]) == (5, 1, 1)
    finally:
        b.close()


def test_a_page_removed_while_holdings_are_announced_is_never_announced(endpoints):
    """The announcing thread reads tier 3 while transfers go on: an eviction that lands between
    reading a page and announcing it wins; a backend clear() stops the announcement."""
    pub, replay = endpoints
    go = threading.Event()
    sks = [bytes([i + 1]) * 16 for i in range(4)]

    def holdings():
        yield [(sks[0], 10, None, [1, 2]), (sks[1], 11, 10, [3, 4])]
        go.wait(10)
        yield [(sks[2], 12, 11, [5, 6]), (sks[3], 13, None, [7, 8])]

    ev = Tier3Events.own_stream(EventsConfig(pub, replay, "rt"), block_size=2, holdings=holdings)
    try:
        replayed(replay, 1)
        ev.removed([sks[2]])  # evicted after the store named it, before the events thread announced it
        go.set()
        assert ev.flush(10)
        got = [(type(e).__name__, e.block_hashes) for e in events_of(replayed(replay, 2))]
        assert got == [("BlockStored", [10, 11]), ("BlockStored", [13])]
        assert ev.stats()["held_announced"] == 3
    finally:
        ev.close()


def test_an_idle_stream_beats_so_a_late_subscriber_sees_its_gap_and_a_bad_period_is_refused(endpoints):
    """Nothing to say for heartbeat_s: one empty batch (a router that subscribed late sees the
    sequence gap and asks the replay socket for the rest); none while batches flow, none when off."""
    pub, replay = endpoints
    beats = []
    ev = Tier3Events(lambda batch: beats.append(batch), block_size=4, joined=False, heartbeat_s=0.2)
    quiet = Tier3Events(lambda batch: beats.append(("quiet", batch)), block_size=4, joined=False, heartbeat_s=0)
    try:
        time.sleep(0.7)
        assert 2 <= len([b for b in beats if not isinstance(b, tuple)]) <= 4
        assert all(b.events == [] for b in beats if not isinstance(b, tuple))
        assert not any(isinstance(b, tuple) for b in beats)
        assert ev.stats()["heartbeats"] >= 2 and ev.stats()["batches"] == 0
    finally:
        ev.close()
        quiet.close()
    for bad in (-1, "soon", float("nan"), 0.01):
        with pytest.raises(ConfigError, match=r"^kv_events_heartbeat_s: expected"):
            BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_heartbeat_s": bad})
    assert BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_heartbeat_s": 0}).kv_events_heartbeat_s == 0
