"""Tier-3 KV events: what this node's partition holds, told to the fleet's router in SGLang's own
wire format (`BlockStored` / `BlockRemoved` with medium DISK, `AllBlocksCleared`).

SGLang 0.5.23 emits KV events for its GPU and CPU tiers only; a KV-aware router (Dynamo's, llm-d's,
SGLang's gateway) therefore never learns that a node's prefix sits in tier 3. This module fills
that gap with SGLang's own event classes and its own ZMQ publisher (PUB socket, sequence numbers,
optional replay socket), so a consumer decodes tier-3 events with the code path it already has.

What the events say, and what they cannot:
- block hashes are SGLang's: `hash_str_to_int64(key)` of the page-hash string SGLang hands the
  backend, the same number SGLang's GPU/CPU events carry for that page when no `extra_key` or
  `cache_salt` namespaces the request (with one, SGLang hashes its events with a seed the backend
  never sees, and the two streams name the page differently);
- `parent_block_hash` is the previous page of the call's chain (the last prefix key for the first);
- `token_ids` is empty: the backend receives page hashes, never tokens (a consumer that needs the
  tokens takes them from SGLang's own BlockStored for the same hash);
- a page tier 3 evicts is announced as `BlockRemoved` when this process wrote it recently enough to
  remember its hash (the newest `remembered_pages`); older evictions are counted as
  `removals_unnamed` and not announced (the store keeps derived keys, not SGLang's hashes).

Cost: nothing when off (no endpoint: this module is not even imported). When on, the transfer
thread only appends one small record per batch to a bounded queue and never waits: a full queue
drops the batch and counts it (`dropped`); one thread builds the events and hands them to SGLang's
publisher (whose own queue may block that thread, never a transfer).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                                 StorageMedium, ZmqEventPublisher)
from sglang.srt.mem_cache.utils import hash_str_to_int64

log = logging.getLogger("radixtier.sglang")

DEFAULT_TOPIC = "radixtier"
QUEUE_BATCHES = 4096          # batches waiting for the publisher thread before new ones are dropped
REMEMBERED_PAGES = 1 << 18    # store key -> SGLang block hash, for naming evictions (~40 MiB at most)


@dataclass(frozen=True)
class EventsConfig:
    """Where tier-3 events go: extra_config `kv_events_endpoint` ('' = off), `kv_events_replay_endpoint`,
    `kv_events_topic`. The endpoint's port is offset by the DP rank, as SGLang's own publisher does."""

    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = DEFAULT_TOPIC

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


# queued records: ("stored", keys, parent_key, store_keys, ok, chained) | ("removed", store_keys) | ("cleared",)
_Record = Tuple


class Tier3Events:
    """One publisher per KV cache (DP rank); see the module docstring. Thread-safe."""

    def __init__(self, config: EventsConfig, block_size: int, dp_rank: int = 0,
                 remembered_pages: int = REMEMBERED_PAGES, queue_batches: int = QUEUE_BATCHES) -> None:
        self.block_size = block_size
        self._remembered_pages = remembered_pages
        self._queue: Deque[_Record] = deque()
        self._queue_batches = queue_batches
        self._cv = threading.Condition(threading.Lock())
        self._running = True
        self._names: "OrderedDict[bytes, int]" = OrderedDict()  # owned by the publisher thread
        self.counters: Dict[str, int] = {"batches": 0, "blocks_stored": 0, "blocks_removed": 0, "cleared": 0,
                                         "dropped": 0, "removals_unnamed": 0, "errors": 0}
        self._publisher = ZmqEventPublisher(dp_rank, endpoint=config.endpoint,
                                            replay_endpoint=config.replay_endpoint or None, topic=config.topic)
        self._thread = threading.Thread(target=self._publish_thread_func, name="radixtier-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called on transfer threads
    def stored(self, keys: Sequence[str], parent_key: Optional[str], store_keys: Sequence[bytes],
               ok: Sequence[bool], chained: bool = True) -> None:
        """Pages of one write call: keys[i] (SGLang's hash string) is durable where ok[i]. chained:
        the keys are one chain (each page's parent is the one before it); else each is parentless."""
        if any(ok):
            self._put(("stored", list(keys), parent_key, list(store_keys), list(ok), chained))

    def removed(self, store_keys: Sequence[bytes]) -> None:
        """Pages tier 3 evicted or dropped (store keys)."""
        if store_keys:
            self._put(("removed", list(store_keys)))

    def cleared(self) -> None:
        self._put(("cleared",))

    def _put(self, record: _Record) -> None:
        with self._cv:
            if not self._running:
                return
            if len(self._queue) >= self._queue_batches:
                self.counters["dropped"] += 1
                return
            self._queue.append(record)
            self._cv.notify()

    # ------------------------------------------------------------------ the publisher thread
    def _publish_thread_func(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._queue:
                    self._cv.wait()
                if not self._queue:
                    return  # closing, and everything queued went out
                record = self._queue.popleft()
            try:
                events = self._events(record)
                if events:
                    self._publisher.publish(KVEventBatch(ts=time.time(), events=events))
                    with self._cv:
                        self.counters["batches"] += 1
            except Exception as exc:  # a publisher failure costs events, never a transfer
                with self._cv:
                    self.counters["errors"] += 1
                log.error("radixtier: tier-3 KV event not published: %s", exc)

    def _events(self, record: _Record) -> List[object]:  # noqa: C901 - three record kinds, one place
        kind = record[0]
        if kind == "cleared":
            self._names.clear()
            with self._cv:
                self.counters["cleared"] += 1
            return [AllBlocksCleared()]
        if kind == "removed":
            hashes, unnamed = [], 0
            for sk in record[1]:
                h = self._names.pop(sk, None)
                if h is None:
                    unnamed += 1
                else:
                    hashes.append(h)
            with self._cv:
                self.counters["blocks_removed"] += len(hashes)
                self.counters["removals_unnamed"] += unnamed
            return [BlockRemoved(block_hashes=hashes, medium=StorageMedium.DISK.value)] if hashes else []
        _kind, keys, parent_key, store_keys, ok, chained = record
        if not chained:  # one parentless event per page
            events = []
            for key, sk, good in zip(keys, store_keys, ok):
                if good:
                    h = hash_str_to_int64(key)
                    self._remember(sk, h)
                    events.append(self._block_stored([h], None))
            with self._cv:
                self.counters["blocks_stored"] += len(events)
            return events
        events: List[object] = []
        run: List[int] = []
        prev = None if parent_key is None else hash_str_to_int64(parent_key)
        run_parent = prev
        for key, sk, good in zip(keys, store_keys, ok):
            h = hash_str_to_int64(key)
            if good:
                if not run:
                    run_parent = prev
                run.append(h)
                self._remember(sk, h)
            elif run:  # a page that did not land breaks the chain: the next run is its own event
                events.append(self._block_stored(run, run_parent))
                run = []
            prev = h
        if run:
            events.append(self._block_stored(run, run_parent))
        with self._cv:
            self.counters["blocks_stored"] += sum(len(e.block_hashes) for e in events)
        return events

    def _block_stored(self, hashes: List[int], parent: Optional[int]) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[], block_size=self.block_size,
                           lora_id=None, medium=StorageMedium.DISK.value)

    def _remember(self, store_key: bytes, block_hash: int) -> None:
        names = self._names
        names[store_key] = block_hash
        names.move_to_end(store_key)
        if len(names) > self._remembered_pages:
            names.popitem(last=False)

    # ------------------------------------------------------------------ closing
    def stats(self) -> Dict[str, int]:
        with self._cv:
            return dict(self.counters, queued=len(self._queue))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (up to `timeout`), then stop SGLang's publisher."""
        with self._cv:
            self._running = False
            self._cv.notify_all()
        self._thread.join(timeout)
        self._publisher.shutdown()
        atexit.unregister(self._publisher.shutdown)  # SGLang registers it; a second call waits 1 s for nothing

