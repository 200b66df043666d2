"""Liveness of a node in the prefix index: its heartbeat, its claim on its node id, and the
re-publication of what its store holds after Redis lost track of it.

Owns our heartbeat (with the token random per process start, see identity.py) and the node
registry entries written with it (the node set, the heartbeat hash), the start's claim on our node
id, the goodbye at close, and re-publication: on reconnection (or when Redis lost our heartbeat,
e.g. after a restart) the node re-publishes everything its store holds and deletes records of
pages it no longer holds (their unpublish may have been dropped from a full queue).

One node id belongs to one live process: a start while another process renews our id's heartbeat
is refused, and a running node that finds another token in its heartbeat says so
(health()["duplicate_node_id"]). Why a room of its own: these are the worker's duties that keep
the node known to the fleet; they share nothing with lookups but the key names.

The republish flag (a threading.Event, created by RedisPrefixIndex) is set by whoever learns that
Redis may lack our records (Heartbeat, Repair on a replaced pages hash, a new republisher) and
cleared by Republication alone, when it runs. No locks of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional

from radixtier.storage.api import Republisher
from radixtier.storage.index.identity import beat_payload, beat_token, instance_token
from radixtier.storage.index.redis_config import RedisIndexConfig
from radixtier.storage.index.redis_conn import Client, Down, Link, is_hex, text
from radixtier.storage.index.redis_health import Counters, Problems
from radixtier.storage.index.redis_keys import Keys
from radixtier.storage.index.redis_publish import PublishQueue
from radixtier.storage.index.redis_repair import Repair

log = logging.getLogger("radixtier.storage.redis")

MAX_CLAIM_WAIT_S = 60.0  # the longest a start waits for a previous process's heartbeat to lapse


class Heartbeat:
    """Our heartbeat and our claim on our node id."""

    def __init__(self, cfg: RedisIndexConfig, keys: Keys, writer: Link, reader: Link, repair: Repair,
                 counters: Counters, problems: Problems, republish_due: threading.Event) -> None:
        self._cfg, self._keys, self._node_id = cfg, keys, cfg.node_id
        self._writer, self._reader = writer, reader
        self._repair, self._counters, self._problems = repair, counters, problems
        self._republish_due = republish_due
        self._token = instance_token()  # in our heartbeat: another token there is another live process

    def beat(self) -> None:
        """Renew our heartbeat (and our place in the node set and heartbeat hash); a reconnection
        or a heartbeat Redis lost asks for a republication; lookups are brought back if down."""
        cfg = self._cfg
        payload = beat_payload(cfg.node_id, self._token, time.time())
        was_down = not self._writer.up
        node_key, all_key, beats_key = self._keys.node(cfg.node_id), self._keys.node_set, self._keys.beats

        def beat(client: Client) -> list:
            return self._repair.pipe(client, [
                (node_key, lambda p: p.set(node_key, payload, px=int(cfg.node_ttl_s * 1000), get=True)),
                (all_key, lambda p: p.sadd(all_key, cfg.node_id)),
                (beats_key, lambda p: p.hset(beats_key, cfg.node_id, f"{time.time():.3f}")),  # outlives the TTL
            ])

        old, _, _ = self._writer.call(beat)
        if was_down:
            self._counters.add("reconnects")
            log.warning("radixtier: prefix index %s reachable again; re-publishing local pages", cfg.url)
            self._republish_due.set()
        if old is None:  # our heartbeat was gone: Redis restarted, or we were presumed dead
            self._republish_due.set()
        else:
            self._check_beat(old)
        self._probe_reader()

    def _check_beat(self, old: bytes) -> None:
        """The heartbeat we replaced: another process's token there means another live process
        beats as our node id (it started while Redis was unreachable, or raced our start)."""
        token = beat_token(old)
        if token is not None and token != self._token:
            self._problems.note("duplicate", f"{self._duplicate_message(token)} (found in a heartbeat of ours)",
                                level=logging.ERROR, kind="identity")

    def _duplicate_message(self, token: Optional[str]) -> str:
        holder = f" (its heartbeat names process {token.split('.', 1)[-1]})" if token else ""
        return (f"node_id: {self._node_id!r} is in use by another live process{holder}; give each node its own "
                f"node_id (the SGLang plugin's extra_config key \"node_id\"), or stop the other process first")

    def _probe_reader(self) -> None:
        """Bring lookups back without waiting for a request to find out that Redis is reachable again."""
        if not self._reader.up:
            try:
                self._reader.call(lambda c: c.ping())
            except Exception:
                pass

    def claim(self) -> None:
        """Take our node id's heartbeat, or refuse to start (ValueError) while another process renews it.

        A heartbeat left by a process that died (no clean close) is still there for up to
        node_ttl_s: we wait until it lapses or is renewed. Renewed means a live process holds the
        id: starting too would hide each node's pages from the other and let one's republication
        delete the other's records. Unchanged for longer than a heartbeat lives (a key without a
        TTL: not a heartbeat) is taken over. Redis unreachable: we start degraded, and the
        heartbeat reports a duplicate later (_check_beat)."""
        if not self._reader.up:
            return
        try:
            self._writer.call(self._claim_with)
        except Down:
            pass

    def _claim_with(self, client: Client) -> None:
        """claim's loop: SET NX our heartbeat; while another stands there, watch it (see claim)."""
        cfg, key = self._cfg, self._keys.node(self._node_id)
        ttl_ms = int(cfg.node_ttl_s * 1000)
        give_up = time.monotonic() + cfg.node_ttl_s + cfg.heartbeat_s
        seen: Optional[bytes] = None
        while not client.set(key, beat_payload(self._node_id, self._token, time.time()), nx=True, px=ttl_ms):
            now = self._repair.tolerant(client, key, lambda c: c.get(key), None)  # a wrong type is no heartbeat
            if now is None:
                continue  # lapsed (or replaced) between the two calls
            if seen is not None and now != seen:
                raise ValueError(self._duplicate_message(beat_token(now)))
            if seen is None:
                seen, give_up = now, self._claim_deadline(client, key, give_up)
            if time.monotonic() >= give_up:
                client.set(key, beat_payload(self._node_id, self._token, time.time()), px=ttl_ms)
                self._problems.note(key, f"{key}: a heartbeat nobody renewed and that did not expire; taken over")
                return
            time.sleep(min(0.05, cfg.heartbeat_s / 4))

    def _claim_deadline(self, client: Client, key: str, give_up: float) -> float:
        """How long to watch a heartbeat we found: our own node_ttl_s and heartbeat_s, or until it
        expires where its holder set a longer TTL (at most MAX_CLAIM_WAIT_S)."""
        left_ms = client.pttl(key)
        give_up = max(give_up, time.monotonic() + min(max(left_ms, 0) / 1000, MAX_CLAIM_WAIT_S))
        log.info("radixtier: node_id %r: waiting up to %.1f s for the heartbeat a previous process left to lapse",
                 self._node_id, give_up - time.monotonic())
        return give_up

    def say_goodbye(self, client: Client) -> None:
        """Delete our heartbeat, unless another process's now stands there (a duplicate's)."""
        key = self._keys.node(self._node_id)
        if beat_token(client.get(key)) == self._token:
            client.delete(key)


class Republication:
    """Re-publishes what the store holds (its republisher's records) and deletes our stale records."""

    def __init__(self, publisher: PublishQueue, writer: Link, keys: Keys, node_id: str, repair: Repair,
                 counters: Counters, republish_due: threading.Event,
                 source: Optional[Republisher] = None) -> None:
        self._publisher, self._writer, self._keys, self._node_id = publisher, writer, keys, node_id
        self._repair, self._counters = repair, counters
        self._republish_due = republish_due
        self._source = source

    def set_source(self, fn: Republisher) -> None:
        """The store's records from now on; republished at the worker's next turn."""
        self._source = fn
        self._republish_due.set()

    def run(self) -> None:
        fn = self._source
        self._republish_due.clear()
        if fn is None:
            return
        held = [(bytes(root), bytes(key), rec) for root, key, rec in fn()]
        saved = self._reconcile_owned({key for _, key, _ in held})
        # A page keeps the root it was published under: lookups ask there (a trailing sidecar window's
        # root is its sequence's first page, which the store's parent links cannot show).
        held = [(saved.get(key, root), key, rec) for root, key, rec in held]
        if held:
            self._counters.add("republished", len(held))
            self._publisher.enqueue([("pub", entry) for entry in held])

    def _reconcile_owned(self, held: set, batch: int = 1000) -> Dict[bytes, bytes]:
        """Roots of our records for pages the store still holds; records of the pages it no longer
        holds are deleted (their unpublish may have been dropped from a full queue)."""
        owned = self._keys.owned(self._node_id)
        items = self._writer.call(lambda c: self._repair.tolerant(
            c, owned, lambda c: list(c.hscan_iter(owned, count=batch)), []))
        saved: Dict[bytes, bytes] = {}
        stale: List[bytes] = []  # 16-byte page keys
        junk: List[bytes] = []  # fields that are no page key at all (kept raw: they may not be UTF-8)
        for k, r in items:
            key_hex, root_hex = text(k), text(r)
            if not (is_hex(key_hex, 32) and is_hex(root_hex, 32)):
                junk.append(k)
                continue
            key, root = bytes.fromhex(key_hex), bytes.fromhex(root_hex)
            if key in held:
                saved[key] = root
            else:
                stale.append(key)
        if junk:
            self._writer.call(lambda c: c.hdel(owned, *junk))
        for i in range(0, len(stale), batch):
            self._publisher.apply_batch([("unpub", (key,)) for key in stale[i:i + batch]])
        if stale:
            self._counters.add("stale_removed", len(stale))
            log.info("radixtier: removed %d index records of pages this node no longer holds", len(stale))
        return saved
