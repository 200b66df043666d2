"""RedisPrefixIndex: which page hashes exist anywhere in the fleet, and where.

Key layout (prefix = "<key_prefix>:<namespace>"):

    <prefix>:{<root>}:p:<page>    HASH node_id -> msgpack record   (one per page; root = the chain's page 0)
    <prefix>:{nodes}:n:<node_id>  STRING with TTL: the node's heartbeat (absent = dead)
    <prefix>:{nodes}:all          SET of node ids ever seen (for garbage collection)
    <prefix>:{nodes}:gc           STRING NX lock: one collector at a time
    <prefix>:{o:<node_id>}        HASH page -> root: what the node published (for unpublish and GC)

The hash tag on the chain root puts a whole chain in one Redis Cluster slot, so a lookup of a
chain is one EVALSHA (one round trip) while chains spread over shards.

Serving never waits on Redis for writes (they go through a background queue) and waits at most
`lookup_timeout_s` for a lookup; while Redis is down, lookups answer "nothing remote" at once,
reconnection is tried with exponential backoff, and on reconnection (or when Redis lost our
heartbeat, e.g. after a restart) the node re-publishes everything its store holds.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

from radixtier.storage.prefix_index import PageRecord
from radixtier.storage.records import RecordError, decode_record, encode_record

log = logging.getLogger("radixtier.storage.redis")

_LOOKUP_LUA = """
local out = {}
for i, k in ipairs(KEYS) do
  local v = redis.call('HGETALL', k)
  if #v == 0 then break end
  out[i] = v
end
return out
"""

_BATCH_RETRIES = 20  # a batch that fails this often in a row (not a connection loss) is dropped
Republisher = Callable[[], Iterable[Tuple[bytes, bytes, PageRecord]]]  # yields (root, key, record)


@dataclass
class RedisIndexConfig:
    url: str = "redis://127.0.0.1:6379/0"
    node_id: str = "local"
    namespace: str = "default"
    key_prefix: str = "radixtier"
    username: Optional[str] = None
    password: Optional[str] = None
    cluster: bool = False
    lookup_timeout_s: float = 0.05
    connect_timeout_s: float = 0.2
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    gc_interval_s: float = 10.0
    publish_queue: int = 200_000
    ssl_ca_certs: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_cert_reqs: str = "required"
    extra: Dict[str, object] = field(default_factory=dict)

    def validate(self) -> None:
        scheme = urlparse(self.url).scheme if isinstance(self.url, str) else None
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis_url: expected redis://, rediss:// or unix://, got {self.url!r}")
        if not isinstance(self.node_id, str) or not self.node_id or any(c in self.node_id for c in "{}: \t\n"):
            raise ValueError(f"node_id: expected a non-empty id without braces, colons or spaces, got {self.node_id!r}")
        for name in ("namespace", "key_prefix"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "{" in v or "}" in v:
                raise ValueError(f"{name}: expected a non-empty string without braces, got {v!r}")
        for name in ("lookup_timeout_s", "connect_timeout_s", "heartbeat_s", "node_ttl_s", "backoff_initial_s",
                     "backoff_max_s", "gc_interval_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {v!r}")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ValueError(f"node_ttl_s: must exceed heartbeat_s ({self.heartbeat_s}), got {self.node_ttl_s}")
        if self.ssl_cert_reqs not in ("required", "optional", "none"):
            raise ValueError(f"ssl_cert_reqs: expected required, optional or none, got {self.ssl_cert_reqs!r}")


class _Down(Exception):
    pass


class RedisPrefixIndex:
    """PrefixIndex over Redis (standalone or Cluster); see the module docstring."""

    def __init__(self, config: RedisIndexConfig, republish: Optional[Republisher] = None) -> None:
        import redis

        config.validate()
        self.config = cfg = config
        self.node_id = cfg.node_id
        self._redis = redis
        self._prefix = f"{cfg.key_prefix}:{cfg.namespace}"
        self._republish_fn = republish
        self._lock = threading.Lock()
        self._queue: Deque[Tuple[str, tuple]] = deque()
        self._queue_cv = threading.Condition(self._lock)
        self._inflight_ops = 0
        self._batch_failures = 0
        self._up = True
        self._down_until = 0.0
        self._backoff = 0.0
        self._live: Dict[str, bool] = {}
        self._live_at = 0.0
        self.counters = {"lookups": 0, "lookup_failures": 0, "rejected_records": 0, "dead_records_ignored": 0,
                         "published": 0, "unpublished": 0, "dropped_ops": 0, "republished": 0, "reconnects": 0,
                         "gc_removed": 0}
        self._client = self._connect()
        self._script = self._client.register_script(_LOOKUP_LUA)
        try:
            self._client.ping()
        except redis.AuthenticationError as exc:
            raise ValueError(f"redis_url: authentication failed for user {cfg.username or 'default'!r}: {exc}") from None
        except redis.ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc) or "NOPERM" in str(exc):
                raise ValueError(f"redis_url: access refused by the server: {exc}") from None
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._mark_down(exc)  # start degraded: serve from local tiers, keep trying
        self._stop = threading.Event()
        self._need_republish = True
        self._worker = threading.Thread(target=self._run, name=f"radixtier-redis-{cfg.node_id}", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------- connection
    def _connect(self):
        cfg, redis = self.config, self._redis
        kw: Dict[str, object] = dict(socket_timeout=cfg.lookup_timeout_s, socket_connect_timeout=cfg.connect_timeout_s,
                                     health_check_interval=0)
        if cfg.username is not None:
            kw["username"] = cfg.username
        if cfg.password is not None:
            kw["password"] = cfg.password
        if urlparse(cfg.url).scheme == "rediss":
            kw.update(ssl_cert_reqs=cfg.ssl_cert_reqs)
            for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if getattr(cfg, k):
                    kw[k] = getattr(cfg, k)
        kw.update(cfg.extra)
        if cfg.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(cfg.url, **kw)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis.from_url(cfg.url, retry=Retry(NoBackoff(), 0), **kw)

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            was_up = self._up
            self._up = False
            self._backoff = min(self.config.backoff_max_s,
                                max(self.config.backoff_initial_s, self._backoff * 2))
            self._down_until = time.monotonic() + self._backoff
        if was_up:
            log.warning("radixtier: prefix index %s unreachable (%s); serving from local tiers, retrying with "
                        "backoff", self.config.url, exc)

    def _call(self, fn):
        if not self._up and time.monotonic() < self._down_until:
            raise _Down()
        try:
            return fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            self._mark_down(exc)
            raise _Down() from exc
        except self._redis.ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc) or "LOADING" in str(exc):
                self._mark_down(exc)
                raise _Down() from exc
            raise

    @property
    def up(self) -> bool:
        return self._up

    # ---------------------------------------------------------------- keys
    def _page_key(self, root: bytes, key: bytes) -> str:
        return f"{self._prefix}:{{{root.hex()}}}:p:{key.hex()}"

    def _node_key(self, node: str) -> str:
        return f"{self._prefix}:{{nodes}}:n:{node}"

    def _owned_key(self, node: str) -> str:
        return f"{self._prefix}:{{o:{node}}}"

    # ---------------------------------------------------------------- interface
    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        if len(keys) != len(records):
            raise ValueError(f"publish: {len(keys)} keys but {len(records)} records")
        self._enqueue([("pub", (bytes(root), bytes(k), r)) for k, r in zip(keys, records)])

    def unpublish(self, keys: Sequence[bytes]) -> None:
        self._enqueue([("unpub", (bytes(k),)) for k in keys])

    def lookup(self, root: bytes, keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]:
        """Leading run of `keys` (one chain under `root`) with live records; [] whenever Redis cannot answer."""
        if not keys:
            return []
        self.counters["lookups"] += 1
        names = [self._page_key(bytes(root), bytes(k)) for k in keys]
        try:
            raw = self._call(lambda: self._script(keys=names, args=[]))
            live = self._live_nodes()
        except _Down:
            self.counters["lookup_failures"] += 1
            return []
        out: List[List[PageRecord]] = []
        for fields in raw or []:
            recs = []
            for i in range(0, len(fields) - 1, 2):
                node = fields[i].decode(errors="replace") if isinstance(fields[i], bytes) else str(fields[i])
                if exclude_self and node == self.node_id:
                    continue
                try:
                    rec = decode_record(fields[i + 1], field_node=node)
                except RecordError as exc:
                    self.counters["rejected_records"] += 1
                    log.debug("radixtier: rejected index record for node %s: %s", node, exc)
                    continue
                if not live.get(node, False):
                    self.counters["dead_records_ignored"] += 1
                    continue
                recs.append(rec)
            if not recs:
                break
            out.append(recs)
        return out

    def set_republisher(self, fn: Republisher) -> None:
        self._republish_fn = fn
        self._need_republish = True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes reached Redis (False if Redis is down or time ran out)."""
        deadline = time.monotonic() + timeout
        with self._queue_cv:
            while self._queue or self._inflight_ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue_cv.wait(min(left, 0.05))
        return True

    def health(self) -> Dict[str, object]:
        with self._lock:
            depth = len(self._queue)
        return {"up": self._up, "queue_depth": depth, **self.counters}

    def close(self) -> None:
        self.flush(timeout=2.0)
        self._stop.set()
        self._worker.join(timeout=5)
        try:
            self._call(lambda: self._client.delete(self._node_key(self.node_id)))  # dead from now on
        except Exception:
            pass
        try:
            self._client.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- liveness
    def _live_nodes(self) -> Dict[str, bool]:
        now = time.monotonic()
        if now - self._live_at < min(1.0, self.config.heartbeat_s):
            return self._live
        all_key = f"{self._prefix}:{{nodes}}:all"
        nodes = sorted(n.decode() if isinstance(n, bytes) else n for n in self._call(lambda: self._client.smembers(all_key)))
        vals = self._call(lambda: self._client.mget([self._node_key(n) for n in nodes])) if nodes else []
        self._live = {n: v is not None for n, v in zip(nodes, vals)}
        self._live_at = now
        return self._live

    # ---------------------------------------------------------------- background work
    def _enqueue(self, ops: List[Tuple[str, tuple]]) -> None:
        with self._queue_cv:
            self._queue.extend(ops)
            over = len(self._queue) - self.config.publish_queue
            for _ in range(max(0, over)):  # bounded: the oldest go; re-publication after an outage restores them
                self._queue.popleft()
                self.counters["dropped_ops"] += 1
            self._queue_cv.notify_all()

    def _run(self) -> None:
        next_beat = 0.0
        next_gc = time.monotonic() + self.config.gc_interval_s
        while not self._stop.is_set():
            now = time.monotonic()
            if not self._up and now < self._down_until:
                self._stop.wait(min(0.05, self._down_until - now))
                continue
            try:
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + self.config.heartbeat_s
                if self._need_republish:
                    self._republish()
                self._drain()
                if now >= next_gc:
                    self.collect_garbage()
                    next_gc = now + self.config.gc_interval_s
            except _Down:
                continue
            except Exception as exc:  # pragma: no cover - never let the worker die
                log.warning("radixtier: prefix index worker error: %s", exc)
                self._stop.wait(0.1)
                continue
            with self._queue_cv:
                if not self._queue and not self._stop.is_set():
                    self._queue_cv.wait(timeout=min(0.05, max(0.0, next_beat - time.monotonic())))

    def _heartbeat(self) -> None:
        cfg = self.config
        payload = f"{cfg.node_id}:{uuid.uuid4().hex[:8]}"
        was_down = not self._up

        def beat():
            pipe = self._client.pipeline(transaction=False) if not cfg.cluster else self._client.pipeline()
            pipe.set(self._node_key(cfg.node_id), payload, px=int(cfg.node_ttl_s * 1000), get=True)
            pipe.sadd(f"{self._prefix}:{{nodes}}:all", cfg.node_id)
            return pipe.execute()

        old, _ = self._call(beat)
        if was_down:
            with self._lock:
                self._up, self._backoff = True, 0.0
            self.counters["reconnects"] += 1
            log.warning("radixtier: prefix index %s reachable again; re-publishing local pages", cfg.url)
            self._need_republish = True
        if old is None:  # our heartbeat was gone: Redis restarted, or we were presumed dead
            self._need_republish = True
        self._live_at = 0.0

    def _republish(self) -> None:
        fn = self._republish_fn
        self._need_republish = False
        if fn is None:
            return
        ops = [("pub", (bytes(root), bytes(key), rec)) for root, key, rec in fn()]
        if ops:
            self.counters["republished"] += len(ops)
            self._enqueue(ops)

    def _drain(self, batch: int = 2000) -> None:
        while True:
            with self._queue_cv:
                if not self._queue:
                    self._queue_cv.notify_all()
                    return
                ops = [self._queue.popleft() for _ in range(min(batch, len(self._queue)))]
                self._inflight_ops = len(ops)
            try:
                self._apply(ops)
            except _Down:
                with self._queue_cv:  # put them back, in order, for after the reconnection
                    self._queue.extendleft(reversed(ops))
                    self._inflight_ops = 0
                raise
            except Exception:  # e.g. a cluster still electing ("cluster is down"): retry a few times
                self._batch_failures += 1
                with self._queue_cv:
                    if self._batch_failures < _BATCH_RETRIES:
                        self._queue.extendleft(reversed(ops))
                    else:
                        self._batch_failures = 0
                        self.counters["dropped_ops"] += len(ops)
                        log.error("radixtier: dropped %d index updates after %d failed attempts (re-publication "
                                  "after the next reconnection restores them)", len(ops), _BATCH_RETRIES)
                    self._inflight_ops = 0
                    self._queue_cv.notify_all()
                raise
            self._batch_failures = 0
            with self._queue_cv:
                self._inflight_ops = 0
                self._queue_cv.notify_all()

    def _apply(self, ops: List[Tuple[str, tuple]]) -> None:
        me = self.node_id
        owned = self._owned_key(me)
        unpub = [args[0] for kind, args in ops if kind == "unpub"]
        roots: Dict[bytes, Optional[bytes]] = {}
        if unpub:
            vals = self._call(lambda: self._client.hmget(owned, [k.hex() for k in unpub]))
            roots = {k: (bytes.fromhex(v.decode()) if v else None) for k, v in zip(unpub, vals)}

        def run():
            pipe = self._client.pipeline(transaction=False) if not self.config.cluster else self._client.pipeline()
            for kind, args in ops:
                if kind == "pub":
                    root, key, rec = args
                    pipe.hset(self._page_key(root, key), me, encode_record(rec))
                    pipe.hset(owned, key.hex(), root.hex())
                else:
                    root = roots.get(args[0])
                    if root is not None:
                        pipe.hdel(self._page_key(root, args[0]), me)
                    pipe.hdel(owned, args[0].hex())
            return pipe.execute()

        self._call(run)
        n_pub = sum(1 for k, _ in ops if k == "pub")
        self.counters["published"] += n_pub
        self.counters["unpublished"] += len(ops) - n_pub

    def collect_garbage(self) -> int:
        """Remove records of nodes whose heartbeat expired (one collector at a time); returns records removed."""
        lock = f"{self._prefix}:{{nodes}}:gc"
        if not self._call(lambda: self._client.set(lock, self.node_id, nx=True, px=int(self.config.gc_interval_s * 1000))):
            return 0
        self._live_at = 0.0
        live = self._live_nodes()
        removed = 0
        for node, alive in live.items():
            if alive or node == self.node_id:
                continue
            owned = self._owned_key(node)
            items = self._call(lambda: self._client.hgetall(owned))
            pipe = self._client.pipeline(transaction=False) if not self.config.cluster else self._client.pipeline()
            for key_hex, root_hex in items.items():
                k = key_hex.decode() if isinstance(key_hex, bytes) else key_hex
                r = root_hex.decode() if isinstance(root_hex, bytes) else root_hex
                pipe.hdel(f"{self._prefix}:{{{r}}}:p:{k}", node)
            pipe.delete(owned)
            pipe.srem(f"{self._prefix}:{{nodes}}:all", node)
            self._call(pipe.execute)
            removed += len(items)
        self.counters["gc_removed"] += removed
        return removed
