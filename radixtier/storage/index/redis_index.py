"""RedisPrefixIndex: which page hashes exist anywhere in the fleet, and where.

This module is the coordinator: it owns the parts below, builds them from one RedisIndexConfig,
hands each the connection, counters and callables it needs, and runs the background worker that
takes turns between them. The parts never call back into it.

    redis_config.py    RedisIndexConfig and its checks (re-exported here)
    redis_keys.py      every key name, and the key layout
    redis_conn.py      clients, up/down states with backoff, what counts as an outage
    redis_access.py    the start's checks: is it Redis, credentials, ACL rights, EVALSHA
    redis_health.py    counters and the problem log that health() reports
    redis_scripts.py   the writers' Lua scripts and how batches of them run
    redis_repair.py    keys of the wrong type: replaced where ours, reported where not
    redis_lookup.py    lookups (the serving path)
    redis_publish.py   the asynchronous publish queue and its drained batches
    redis_liveness.py  heartbeat, claim on our node id, republication
    redis_gc.py        collection of dead nodes' records
    redis_admin.py     operator tools (`radixtier index`); only the CLI loads it

Serving never waits on Redis for writes (they go through a background queue) and waits at most
`lookup_timeout_s` for a lookup; while Redis is down, lookups answer "nothing remote" at once,
reconnection is tried with exponential backoff, and on reconnection (or when Redis lost our
heartbeat, e.g. after a restart) the node re-publishes everything its store holds and deletes
records of pages it no longer holds (their unpublish may have been dropped from a full queue).
Lookups and the background writer use separate clients with separate up/down states: a slow
write batch (longer `write_timeout_s`) never switches lookups off.

Registry data is untrusted (see redis_repair.py); each problem met is listed in
health()["registry_problems"] and logged at most once a minute, and publishing goes on meanwhile.
One node id belongs to one live process (see redis_liveness.py; health()["duplicate_node_id"]).

No locks of its own: the worker's stop and the republish flag are Events; each part's locks are
described in its module.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from radixtier.storage.api import LocationTuple, PageRecord, Republisher
from radixtier.storage.index.redis_access import check_access
from radixtier.storage.index.redis_config import RedisIndexConfig
from radixtier.storage.index.redis_conn import Down, Link, Pinger, connect, down_errors
from radixtier.storage.index.redis_gc import Collector
from radixtier.storage.index.redis_health import Counters, Problems
from radixtier.storage.index.redis_keys import Keys
from radixtier.storage.index.redis_liveness import Heartbeat, Republication
from radixtier.storage.index.redis_lookup import Lookups
from radixtier.storage.index.redis_publish import PublishQueue
from radixtier.storage.index.redis_repair import Repair
from radixtier.storage.index.redis_scripts import ScriptRunner

__all__ = ["RedisIndexConfig", "RedisPrefixIndex"]


class RedisPrefixIndex:
    """PrefixIndex over Redis (standalone or Cluster); see the module docstring."""

    def __init__(self, config: RedisIndexConfig, republish: Optional[Republisher] = None,
                 serve: bool = True) -> None:
        """serve=False: an operator's view (`radixtier index`): same connection, checks and errors,
        but no worker, no heartbeat -- the tool never appears in the fleet as a node."""
        import redis

        config.validate()
        self.config = cfg = config
        self.node_id = cfg.node_id
        self._keys = keys = Keys(cfg.key_prefix, cfg.namespace)
        self._counters = counters = Counters()
        self._problems = problems = Problems()
        down = down_errors(redis)
        backoff = (cfg.backoff_initial_s, cfg.backoff_max_s)
        server = (redis.RedisError,)
        budget = max(cfg.connect_timeout_s, cfg.lookup_timeout_s)
        self._pinger = Pinger(lambda: connect(cfg, redis, budget), cfg.cluster)  # liveness after a slow lookup
        self._reader = Link("lookups", cfg.url, lambda: connect(cfg, redis, cfg.lookup_timeout_s), down, server,
                            backoff, slow_errors=(redis.TimeoutError,), answers=self._pinger.answers)
        self._writer = Link("writes", cfg.url, lambda: connect(cfg, redis, cfg.writer_timeout()), down, server,
                            backoff)
        self._republish_due = threading.Event()  # Redis may lack our records: republish at the next turn
        self._republish_due.set()
        scripts = ScriptRunner(redis, cfg.cluster)
        repair = Repair(redis, cfg.cluster, problems, counters, keys.owned(cfg.node_id), self._republish_due.set)
        self._lookups = Lookups(self._reader, keys, cfg.node_id, cfg.lookup_max_holders, cfg.heartbeat_s, counters)
        self._publisher = PublishQueue(self._writer, keys, cfg.node_id, cfg.publish_queue, cfg.cluster, scripts,
                                    repair, counters, problems)
        self._beats = Heartbeat(cfg, keys, self._writer, self._reader, repair, counters, problems,
                                self._republish_due)
        self._republication = Republication(self._publisher, self._writer, keys, cfg.node_id, repair, counters,
                                            self._republish_due, republish)
        self._collector = Collector(self._writer, keys, cfg.node_id, cfg.gc_interval_s, cfg.cluster, scripts,
                                    repair, counters, problems)
        self._stop = threading.Event()
        self._worker: Optional[threading.Thread] = None
        try:
            check_access(self._reader, cfg, keys, redis, scripts, down)
            if serve:
                self._beats.claim()
        except BaseException:  # refused: nothing left behind (no connections, no heartbeat)
            self._reader.close()
            self._writer.close()
            raise
        if serve:
            self._worker = threading.Thread(target=self._run, name=f"radixtier-redis-{cfg.node_id}", daemon=True)
            self._worker.start()

    @property
    def up(self) -> bool:
        """Whether lookups are being answered by Redis (writes have their own state, see health())."""
        return self._reader.up

    @property
    def counters(self) -> Dict[str, int]:
        """The live counters (health() returns a copy)."""
        return self._counters.values

    @property
    def writes(self) -> Link:
        """The background writes' client and up/down state; operator tools (redis_admin.py) read through it."""
        return self._writer

    # ---------------------------------------------------------------- interface
    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        self._publisher.publish(root, keys, records)

    def unpublish(self, keys: Sequence[bytes]) -> None:
        self._publisher.unpublish(keys)

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]:
        """Leading run of `keys` (one chain under `root`) with live records; [] whenever Redis cannot answer.

        root=None: the caller does not know where the chain starts (SGLang's prefetch passes only the
        anchor node's ancestors, or nothing, as prefix keys); the root is read from the first key's
        root pointer first. Round trips: one MGET with a known root, a GET and an MGET without
        one, plus one MGET of heartbeats when the liveness cache (min(1 s, heartbeat_s)) is stale."""
        return self._lookups.lookup(root, keys, exclude_self)

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes], namespace: str) -> List[LocationTuple]:
        """The fast path of `lookup` for a reader of tier-3 namespace `namespace`: per page of the
        leading run, one location another live node holds there (decoded in bulk, no per-record
        objects). Same round trips as lookup()."""
        return self._lookups.lookup_locations(root, keys, namespace)

    def set_republisher(self, fn: Republisher) -> None:
        self._republication.set_source(fn)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes reached Redis (False if Redis is down or time ran out)."""
        return self._publisher.flush(timeout)

    def health(self) -> Dict[str, object]:
        """`up`: lookups are answered; `writer_up`: publishes reach Redis (False while the link is
        down, our user lacks a right, or the last batch failed: `last_publish_error`);
        `access_denied`: the server's NOPERM answer while our user lacks a right (up and writer_up
        are then False as well); `registry_problems`: bad registry data met in the last minutes
        (what was replaced or skipped); `duplicate_node_id`: another live process beats as our id;
        `recent_errors`: background failures of the last minutes (each also logged once a minute)."""
        depth = self._publisher.depth()
        counters = self._counters.snapshot()
        denied = self._reader.denied or self._writer.denied
        duplicate = self._problems.recent("identity")
        publish_error = self._publisher.last_error
        return {"up": self._reader.up and not self._reader.denied,
                "writer_up": self._writer.up and not self._writer.denied and not publish_error,
                "access_denied": denied, "last_publish_error": publish_error,
                "duplicate_node_id": duplicate[-1] if duplicate else "",
                "registry_problems": self.registry_problems(), "recent_errors": self._problems.recent("errors"),
                "queue_depth": depth, **counters}

    def registry_problems(self) -> List[str]:
        """Bad registry data met in the last minutes: what was replaced, skipped or only reported."""
        return self._problems.recent("registry")

    def collect_garbage(self, max_nodes: int = 2000, wait_lock: bool = False) -> int:
        """Remove records of nodes whose heartbeat expired (one collector at a time); returns records
        removed. At most `max_nodes` ids of the node set per call (see redis_gc.Collector.collect)."""
        return self._collector.collect(max_nodes, wait_lock)

    def close(self) -> None:
        if self._worker is not None:
            self.flush(timeout=2.0)
            self._stop.set()
            self._worker.join(timeout=5)
            try:
                self._writer.call(self._beats.say_goodbye)  # dead from now on
            except Exception:
                pass
        self._reader.close()
        self._writer.close()
        self._pinger.close()

    # ---------------------------------------------------------------- background work
    def _run(self) -> None:
        """The worker: heartbeat, republication, publishing and GC, each its own step, so that one
        failing (a bad registry key used to fail the heartbeat on every loop, and nothing after it
        ran) never stops the others; an outage backs them all off (see Link)."""
        next_beat = 0.0
        next_gc = time.monotonic() + self.config.gc_interval_s
        w = self._writer
        while not self._stop.is_set():
            now = time.monotonic()
            if not w.up and now < w.down_until:
                self._stop.wait(min(0.05, w.down_until - now))
                continue
            ok = True
            if now >= next_beat or not w.up:  # after an outage the heartbeat goes first: it triggers republish
                ok = self._step(self._beats.beat)
                next_beat = now + self.config.heartbeat_s
            if self._republish_due.is_set() and w.up:
                ok = self._step(self._republication.run) and ok
            if w.up:
                ok = self._step(self._publisher.drain) and ok
            if now >= next_gc and w.up:
                ok = self._step(self.collect_garbage) and ok
                next_gc = now + self.config.gc_interval_s
            if not ok:
                self._stop.wait(0.1)  # a failed step is retried, not spun on
                continue
            self._publisher.wait_for_work(min(0.05, max(0.0, next_beat - time.monotonic())), self._stop)

    def _step(self, fn: Callable[[], object]) -> bool:
        """One step of the worker; False when it failed (an outage, which the link backs off, or
        anything else, reported once a minute: never let the worker die)."""
        try:
            fn()
            return True
        except Down:
            return False
        except Exception as exc:
            self._problems.note(f"worker:{type(exc).__name__}", f"prefix index worker error: {exc}", kind="errors")
            return False
