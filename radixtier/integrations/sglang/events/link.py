"""The backend's handle on its tier-3 KV events: off, on their own stream, or joined to SGLang's.

- extra_config `kv_events_endpoint` set: tier-3 events on their own ZMQ stream from the start, on
  the rank SGLang itself publishes from (pp, attention-TP and CP rank 0: one stream per KV cache);
- SGLang's `--kv-events-config` selects publisher "radixtier": when SGLang creates that publisher
  (after the backend, see event_sinks.py) tier-3 events join its stream -- or, with an own stream,
  learn token ids from it. SGLang creates it only on its publishing ranks, so no rank test is needed.

Either way the events start by announcing what tier 3 already holds (`holdings`: the store's
router tags, so a restarted worker's partition is known to the router before its first request),
and each page written carries its tag (`tags_for`).

Light on purpose: with neither, kv_events.py (and SGLang's event module) is never imported and each
call below is one attribute test.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence

from radixtier.integrations.sglang.events import sinks as event_sinks
from radixtier.integrations.sglang.backend.config import BackendConfig
from radixtier.integrations.sglang.backend.keys import RankIdentity
from radixtier.storage.api import RouterTag, TaggedPage

if TYPE_CHECKING:  # pragma: no cover - loaded only when events are on
    from radixtier.integrations.sglang.events.kv_events import Tier3Events

log = logging.getLogger("radixtier.sglang")


class EventsLink:
    """Owns the backend's Tier3Events (at most one); see the module docstring."""

    def __init__(self, config: BackendConfig, rank: RankIdentity, block_size: Callable[[], int],
                 holdings: Optional[Callable[[], Iterable[List[TaggedPage]]]] = None) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self._block_size = block_size
        self._holdings = holdings
        self._token_wait_s = config.kv_events_token_wait_s
        self._heartbeat_s = config.kv_events_heartbeat_s
        self.current: Optional["Tier3Events"] = None
        if config.kv_events_endpoint and not (rank.tp_rank or rank.pp_rank or rank.cp_rank):
            from radixtier.integrations.sglang.events.kv_events import EventsConfig, Tier3Events

            self.current = Tier3Events.own_stream(
                EventsConfig(config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic),
                block_size(), dp_rank=rank.dp_rank, token_wait_s=self._token_wait_s, holdings=holdings,
                heartbeat_s=self._heartbeat_s)
            log.info("radixtier: tier-3 KV events (medium DISK) on %s, topic %r", config.kv_events_endpoint,
                     config.kv_events_topic)
        self._cancel = event_sinks.when_offered(self._on_sglang_stream)

    def _on_sglang_stream(self, stream: Any) -> None:
        from radixtier.integrations.sglang.events.kv_events import Tier3Events

        with self._lock:
            if self._closed:
                return
            if self.current is not None:
                self.current.learn_from(stream)
                log.info("radixtier: tier-3 KV events learn token ids from SGLang's KV-event stream")
                return
            self.current = Tier3Events.joined_to(stream, self._block_size(), token_wait_s=self._token_wait_s,
                                                 holdings=self._holdings, heartbeat_s=self._heartbeat_s)
        log.info("radixtier: tier-3 KV events (medium DISK) join SGLang's KV-event stream")

    # the backend's calls (transfer threads); nothing when events are off
    def tags_for(self, keys: Sequence[str], parent_key: Optional[str],
                 chained: bool = True) -> Optional[List[Optional[RouterTag]]]:
        events = self.current
        return None if events is None else events.tags_for(keys, parent_key, chained)

    def stored(self, keys: Sequence[str], parent_key: Optional[str], store_keys: Sequence[bytes],
               ok: Sequence[bool], chained: bool = True) -> None:
        events = self.current
        if events is not None:
            events.stored(keys, parent_key, store_keys, ok, chained)

    def removed(self, store_keys: Sequence[bytes]) -> None:
        events = self.current
        if events is not None:
            events.removed(store_keys)

    def cleared(self) -> None:
        events = self.current
        if events is not None:
            events.cleared()

    def stats(self) -> Optional[Dict[str, int]]:
        events = self.current
        return None if events is None else events.stats()

    def close(self) -> None:
        self._cancel()
        with self._lock:
            self._closed = True
            events, self.current = self.current, None
        if events is not None:
            events.close()
