"""Tier-3 KV events (integrations/sglang/kv_events.py): SGLang's own event classes and ZMQ
publisher, read back as a router would -- over ZMQ, decoded with SGLang's msgspec types."""

from __future__ import annotations

import threading
import time

import pytest

from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.disaggregation.kv_events")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                                                 KVEventBatch, ZmqEventPublisher)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.utils import hash_str_to_int64  # noqa: E402

from radixtier.integrations.sglang.config import BackendConfig, ConfigError  # noqa: E402
from radixtier.integrations.sglang.kv_events import EventsConfig, Tier3Events  # noqa: E402
from radixtier.testing.sglang_pools import attach, chain_keys, make_host_pool, slots  # noqa: E402

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replayed(replay_endpoint: str, want: int, timeout: float = 10.0) -> list:
    """Every batch the publisher sent, asked from its replay socket (no PUB/SUB join race), as
    SGLang's msgspec types; waits until `want` batches were published."""
    ctx = zmq.Context.instance()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    deadline = time.monotonic() + timeout
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay_endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        try:
            while sock.poll(2000):
                _empty, _topic, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    break
                batches.append(decoder.decode(payload))
        finally:
            sock.close()
        if len(batches) >= want or time.monotonic() > deadline:
            return batches
        time.sleep(0.05)


def events_of(batches: list) -> list:
    return [e for b in batches for e in b.events]


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"


def test_events_say_what_tier_3_holds_in_sglangs_format(endpoints):
    pub, replay = endpoints
    ev = Tier3Events(EventsConfig(pub, replay, "rt"), block_size=64)
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
    ev = Tier3Events(EventsConfig(pub, replay), block_size=64, queue_batches=2)
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

    code = ("import sys, radixtier.integrations.sglang.backend\n"
            "print('radixtier.integrations.sglang.kv_events' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    for bad in ("5600", "http://x:1", "tcp:/x"):
        with pytest.raises(ConfigError, match=r"^kv_events_endpoint: expected a ZMQ endpoint"):
            BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_endpoint": bad})
    cfg = BackendConfig.from_extra_config({"path": "/tmp/x.img", "kv_events_endpoint": "tcp://*:5600"})
    assert (cfg.kv_events_endpoint, cfg.kv_events_topic) == ("tcp://*:5600", "radixtier")
