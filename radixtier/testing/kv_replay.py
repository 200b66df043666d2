"""KV-event batches read back from a publisher's replay socket (SGLang's ZMQ ROUTER protocol), for
tests: no PUB/SUB join race, every batch since the first, decoded with SGLang's msgspec types."""

from __future__ import annotations

import time

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch

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
                batch = decoder.decode(payload)
                if batch.events:  # an empty batch is the stream's heartbeat
                    batches.append(batch)
        finally:
            sock.close()
        if len(batches) >= want or time.monotonic() > deadline:
            return batches
        time.sleep(0.05)


def events_of(batches: list) -> list:
    return [e for b in batches for e in b.events]
