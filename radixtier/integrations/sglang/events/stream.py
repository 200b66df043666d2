"""radixtier's KV-event publisher for SGLang: `--kv-events-config '{"publisher": "radixtier", ...}'`.

It is SGLang's own `ZmqEventPublisher` (same socket, sequence numbers, replay buffer and settings:
endpoint, replay_endpoint, topic, buffer_steps, hwm, ...) with two additions:

- tier-3 events join SGLang's stream: the backend publishes `BlockStored`/`BlockRemoved` with
  medium DISK through `publish_tier3`, so one worker endpoint carries every tier in one sequence,
  which is how routers subscribe (one ZMQ source per worker and DP rank);
- every batch SGLang publishes is shown to one observer (the backend's tier-3 events), which learns
  from SGLang's own `BlockStored` the token ids of each page hash -- what a router hashes to match
  a request (Dynamo's indexer ignores a stored block without tokens) -- and sees SGLang's
  `AllBlocksCleared`, after which it announces again what tier 3 still holds.

The observer runs on SGLang's scheduler thread: it only appends the batch to a bounded queue.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Optional

from sglang.srt.disaggregation.kv_events import EventBatch, ZmqEventPublisher

from radixtier.integrations.sglang.events import sinks as event_sinks

PUBLISHER_NAME = "radixtier"


class RadixtierEventPublisher(ZmqEventPublisher):
    """SGLang's ZMQ publisher that also carries tier 3 (see the module docstring)."""

    def __init__(self, attn_dp_rank: int, **config: Any) -> None:
        super().__init__(attn_dp_rank, **config)
        self._observer: Optional[Callable[[EventBatch], None]] = None
        event_sinks.offer(self)

    def observe(self, observer: Callable[[EventBatch], None]) -> None:
        """Show every batch SGLang publishes to `observer` (one at a time: the newest). It must not block."""
        self._observer = observer

    def unobserve(self, observer: Callable[[EventBatch], None]) -> None:
        """Stop showing batches to `observer`, if it is still the one shown them."""
        if self._observer == observer:
            self._observer = None

    def publish(self, events: EventBatch) -> None:
        super().publish(events)
        observer = self._observer
        if observer is not None:
            observer(events)

    def publish_tier3(self, events: EventBatch) -> None:
        """A batch of tier-3 events, into the same stream (not shown to the observer)."""
        super().publish(events)

    def shutdown(self) -> None:
        event_sinks.withdraw(self)
        self._observer = None
        super().shutdown()
        atexit.unregister(self.shutdown)  # SGLang registers it; a second call waits 1 s for nothing

