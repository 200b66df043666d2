"""RedisPrefixIndex: which page hashes exist anywhere in the fleet, and where.

Key layout (prefix = "<key_prefix>:<namespace>"; root = the chain's page 0):

    <prefix>:{<root>}:p:<page>    STRING the page's holders: 96-byte entries (node id, NUL-padded to 48
                                  bytes, then its 48-byte record; at most 16, writers replace the oldest)
    <prefix>:{<page>}:r           STRING the page's root (for lookups that do not know where the chain starts)
    <prefix>:{nodes}:n:<node_id>  STRING with TTL: the node's heartbeat (absent = dead)
    <prefix>:{nodes}:all          SET of node ids ever seen (for garbage collection)
    <prefix>:{nodes}:beats        HASH node -> time of its last heartbeat (kept after the TTL key expires)
    <prefix>:{nodes}:gc           STRING NX lock: one collector at a time
    <prefix>:{o:<node_id>}        HASH page -> root: what the node published (for unpublish and GC)

Why a packed value per page: a chain lookup is then one MGET (no script, one server call) whose
cost grows with the chain's length only, decoded in bulk (numpy); a hash per page read through a
Lua script cost two server calls per page (~1 ms for 512 pages), and one log per chain grew with
everything a node ever held under a popular root. Writers change only their own entry, through a
small script per page in a pipeline, off the serving path. The hash tag on the chain root puts a
whole chain in one Redis Cluster slot (one MGET), while chains spread over shards.

Serving never waits on Redis for writes (they go through a background queue) and waits at most
`lookup_timeout_s` for a lookup; while Redis is down, lookups answer "nothing remote" at once,
reconnection is tried with exponential backoff, and on reconnection (or when Redis lost our
heartbeat, e.g. after a restart) the node re-publishes everything its store holds and deletes
records of pages it no longer holds (their unpublish may have been dropped from a full queue).
Lookups and the background writer use separate clients with separate up/down states: a slow
write batch (longer `write_timeout_s`) never switches lookups off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple
from urllib.parse import parse_qs, urlparse

from radixtier.storage import validate
from radixtier.storage.api import PageRecord, Republisher
from radixtier.storage.api import LocationTuple
from radixtier.storage.index.packed_mget import Redirected, mget_command, packed_mget
from radixtier.storage.index.records import (ENTRY_BYTES, MAX_HOLDERS, PageHolders, encode_record,
                                             node_field)

log = logging.getLogger("radixtier.storage.redis")

# Writers' scripts, one page (KEYS[1]) each, so a pipeline of them stays within a Cluster slot per
# chain. A value that is not whole entries, or is oversized, is foreign: it is replaced.
_UPSERT_LUA = """
local v = redis.call('GET', KEYS[1]) or ''
local e = tonumber(ARGV[3])
if #v % e ~= 0 or #v > e * 4 * tonumber(ARGV[4]) then v = '' end
local me = ARGV[1]
for i = 0, #v / e - 1 do
  if string.sub(v, i * e + 1, i * e + #me) == me then
    redis.call('SET', KEYS[1], string.sub(v, 1, i * e) .. me .. ARGV[2] .. string.sub(v, (i + 1) * e + 1))
    return #v / e
  end
end
if #v / e >= tonumber(ARGV[4]) then v = string.sub(v, e + 1) end
redis.call('SET', KEYS[1], v .. me .. ARGV[2])
return #v / e + 1
"""
_REMOVE_LUA = """
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local e = tonumber(ARGV[2])
if #v % e ~= 0 then redis.call('DEL', KEYS[1]) return 0 end
local me = ARGV[1]
for i = 0, #v / e - 1 do
  if string.sub(v, i * e + 1, i * e + #me) == me then
    v = string.sub(v, 1, i * e) .. string.sub(v, (i + 1) * e + 1)
    break
  end
end
if #v == 0 then redis.call('DEL', KEYS[1]) return 0 end
redis.call('SET', KEYS[1], v)
return #v / e
"""

_UPSERT_SHA = __import__("hashlib").sha1(_UPSERT_LUA.encode()).hexdigest()  # the ACL probe's EVALSHA
_BATCH_RETRIES = 20
_ROOT_PTR_TTL_S = 7 * 24 * 3600  # refreshed by every publish (and republish) of the page  # a batch that fails this often in a row (not a connection loss) is dropped


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
    write_timeout_s: Optional[float] = None  # None: max(1 s, 20 x lookup_timeout_s)
    connect_timeout_s: float = 0.2
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    gc_interval_s: float = 10.0
    publish_queue: int = 200_000
    lookup_max_holders: int = 4  # records returned per page (a random sample when more nodes hold it)
    ssl_ca_certs: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_cert_reqs: str = "required"
    extra: Dict[str, object] = field(default_factory=dict)

    def validate(self, require_url: bool = True) -> None:
        """Raise ValueError naming the first bad field. require_url=False checks everything that
        does not depend on a URL (a config whose Redis is not switched on yet)."""
        scheme = urlparse(self.url).scheme if isinstance(self.url, str) else None
        if require_url or self.url:
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"redis_url: expected redis://, rediss:// or unix://, got {self.url!r}")
        validate.node_id("node_id", self.node_id)
        for name in ("namespace", "key_prefix"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "{" in v or "}" in v:
                raise ValueError(f"{name}: expected a non-empty string without braces, got {v!r}")
        for name in ("lookup_timeout_s", "connect_timeout_s", "heartbeat_s", "node_ttl_s", "backoff_initial_s",
                     "backoff_max_s", "gc_interval_s"):
            validate.positive_seconds(name, getattr(self, name))
        if self.write_timeout_s is not None:
            validate.positive_seconds("write_timeout_s", self.write_timeout_s)
        if self.cluster and (require_url or self.url):
            self._validate_cluster_url()
        if self.node_ttl_s <= self.heartbeat_s:
            raise ValueError(f"node_ttl_s: must exceed heartbeat_s ({self.heartbeat_s}), got {self.node_ttl_s}")
        validate.one_of("ssl_cert_reqs", self.ssl_cert_reqs, validate.SSL_CERT_REQS)
        if scheme != "rediss" and (require_url or self.url):
            for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: set to {getattr(self, name)!r}, but redis_url {self.url!r} is not "
                                     f"rediss:// and would connect in plaintext; use a rediss:// URL or drop {name}")
            if self.ssl_cert_reqs != "required":
                raise ValueError(f"ssl_cert_reqs: set to {self.ssl_cert_reqs!r}, but redis_url {self.url!r} is not "
                                 f"rediss:// (no TLS at all); use a rediss:// URL or drop ssl_cert_reqs")
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            v = getattr(self, name)
            if v and not os.path.isfile(v):  # fail the start, not the first TLS handshake
                raise ValueError(f"{name}: {v} does not exist or is not a file")
        for name, hi in (("lookup_max_holders", 255), ("publish_queue", 1 << 30)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ValueError(f"{name}: expected a whole number from 1 to {hi}, got {v!r}")

    def _validate_cluster_url(self) -> None:
        """Cluster clients reject these only when built; said here so that "unreachable" is never a config error."""
        u = urlparse(self.url)
        if u.scheme == "unix":
            raise ValueError(f"redis_url: Redis Cluster needs redis:// or rediss://, got {self.url!r}")
        if u.path not in ("", "/", "/0") or parse_qs(u.query).get("db", ["0"]) != ["0"]:
            raise ValueError(f"redis_url: Redis Cluster has only database 0, got {self.url!r}")

    def writer_timeout(self) -> float:
        """Socket timeout of background writes: batches are big, and no request waits on them."""
        return self.write_timeout_s if self.write_timeout_s is not None else max(1.0, 20 * self.lookup_timeout_s)


class _Down(Exception):
    pass


class _ChainFailed(Exception):
    """One lookup failed (e.g. timed out on its chain) while the server still answers: not an outage."""


# Server answers that mean "not now" (failover, loading, a busy script, out of memory): back off as if
# the connection were lost, instead of raising into the caller or hammering the server.
_UNAVAILABLE = frozenset({"CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN", "READONLY", "BUSY", "OOM", "LOADING",
                          "NOAUTH", "WRONGPASS", "NOPERM"})


def _beat_time(beat) -> Optional[float]:
    """When a heartbeat was written (its payload is node|unix time|nonce), or None."""
    try:
        return float(_text(beat).rsplit("|", 2)[1])
    except (IndexError, ValueError, TypeError, AttributeError):
        return None


def _float(v) -> Optional[float]:
    try:
        return float(_text(v)) if v is not None else None
    except ValueError:
        return None


def _is_hex(v: str, n: int) -> bool:
    return len(v) == n and all(c in "0123456789abcdef" for c in v)


def _unavailable(exc: BaseException) -> bool:
    """Whether a server error says Redis cannot serve now (redis-py strips the code off the message)."""
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return str(code).upper() in _UNAVAILABLE


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Link:
    """One Redis client and its own up/down state, so a slow write batch never switches lookups off."""

    def __init__(self, name: str, url: str, connect: Callable[[], object], down_errors: tuple,
                 server_errors: tuple, backoff: Tuple[float, float], slow_errors: tuple = ()) -> None:
        self.name, self.url = name, url
        self._slow_errors = slow_errors  # a reply that did not come in time: maybe just this call's
        self._connect = connect
        self._down_errors, self._server_errors = down_errors, server_errors
        self._backoff_initial, self._backoff_max = backoff
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self.client = None
        self.up = True
        self.down_until = 0.0
        self.backoff = 0.0
        self.denied = ""  # the server's NOPERM answer while our user lacks a right this link needs

    def ensure_client(self):
        """The client, built on first use: a Cluster client connects when built, and may not be able to yet."""
        client = self.client
        if client is None:
            with self._build_lock:  # not self._lock: marking down must never wait for a connect
                if self.client is None:
                    self.client = self._connect()
                client = self.client
        return client

    def call(self, fn: Callable[[object], object], build: bool = True, chain: bool = False):
        """fn(client), or _Down at once while backing off and whenever Redis cannot answer.

        build=False (lookups) never builds a missing client: building a Cluster client connects, which
        may take connect_timeout_s; the background worker builds it instead. chain=True (lookups): a
        timeout or lost connection is first checked with a PING; if the server answers, the failure
        was this call's own (a slow chain) and raises _ChainFailed without switching the link off.
        """
        if not self.up and time.monotonic() < self.down_until:
            raise _Down()
        client = None
        try:
            client = self.ensure_client() if build else self.client
            if client is None:
                raise _Down()
            out = fn(client)
        except self._down_errors as exc:
            if chain and isinstance(exc, self._slow_errors) and client is not None and self._answers_ping(client):
                raise _ChainFailed() from exc
            self.mark_down(exc)
            raise _Down() from exc
        except self._server_errors as exc:
            if _unavailable(exc):
                if "NOPERM" in str(getattr(exc, "status_code", "") or "").upper() or \
                        type(exc).__name__ == "NoPermissionError":
                    self.denied = str(exc)
                self.mark_down(exc)
                raise _Down() from exc
            raise
        if not self.up:
            self._mark_up()
        self.denied = ""
        return out

    @staticmethod
    def _answers_ping(client) -> bool:
        try:
            return bool(client.ping())
        except Exception:
            return False

    def mark_down(self, exc: BaseException) -> None:
        with self._lock:
            was_up, self.up = self.up, False
            self.backoff = min(self._backoff_max, max(self._backoff_initial, self.backoff * 2))
            self.down_until = time.monotonic() + self.backoff
        if was_up:
            log.warning("radixtier: prefix index %s unreachable for %s (%s); serving from local tiers, retrying "
                        "with backoff", self.url, self.name, exc)

    def _mark_up(self) -> None:
        with self._lock:
            was_up, self.up, self.backoff = self.up, True, 0.0
        if not was_up:
            log.warning("radixtier: prefix index %s reachable again for %s", self.url, self.name)

    def close(self) -> None:
        with self._lock:
            client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


class RedisPrefixIndex:
    """PrefixIndex over Redis (standalone or Cluster); see the module docstring."""

    def __init__(self, config: RedisIndexConfig, republish: Optional[Republisher] = None,
                 serve: bool = True) -> None:
        """serve=False: an operator's view (`radixtier index`): same connection, checks and errors,
        but no worker, no heartbeat -- the tool never appears in the fleet as a node."""
        import redis
        from redis.exceptions import ClusterError, RedisClusterException

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
        self._live: Dict[str, Tuple[bool, float]] = {}  # node -> (alive, when read); bounded, see _liveness
        self._live_lock = threading.Lock()  # a leaf lock: held for dict updates only, never during I/O
        self._gc_cursor = 0
        self._me_field = node_field(cfg.node_id)
        self._scripts: Dict[str, object] = {}  # name -> redis-py Script, registered on first use
        self._counters_lock = threading.Lock()
        self.counters = {"lookups": 0, "lookup_failures": 0, "chain_failures": 0, "rejected_records": 0,
                         "dead_records_ignored": 0,
                         "published": 0, "unpublished": 0, "dropped_ops": 0, "republished": 0, "reconnects": 0,
                         "gc_removed": 0, "stale_removed": 0}
        down = (redis.ConnectionError, redis.TimeoutError, OSError, RedisClusterException, ClusterError)
        backoff = (cfg.backoff_initial_s, cfg.backoff_max_s)
        server = (redis.RedisError,)
        self._reader = _Link("lookups", cfg.url, lambda: self._connect(cfg.lookup_timeout_s), down, server, backoff,
                             slow_errors=(redis.TimeoutError,))
        self._writer = _Link("writes", cfg.url, lambda: self._connect(cfg.writer_timeout()), down, server, backoff)
        self._check_access(down)
        self._stop = threading.Event()
        self._need_republish = True
        self._worker: Optional[threading.Thread] = None
        if serve:
            self._worker = threading.Thread(target=self._run, name=f"radixtier-redis-{cfg.node_id}", daemon=True)
            self._worker.start()

    # ---------------------------------------------------------------- connection
    def _connect(self, socket_timeout: float):
        cfg, redis = self.config, self._redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: Dict[str, object] = dict(socket_timeout=socket_timeout, socket_connect_timeout=cfg.connect_timeout_s,
                                     health_check_interval=0, retry=Retry(NoBackoff(), 0))  # we back off ourselves
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

            return RedisCluster.from_url(cfg.url, **kw)  # connects now: may raise RedisClusterException
        return redis.Redis.from_url(cfg.url, **kw)

    def _check_access(self, down: tuple) -> None:
        """Refused credentials are a configuration error; an unreachable Redis only starts us degraded."""
        redis = self._redis
        try:
            client = self._reader.ensure_client()
            client.ping()
            self._probe_rights(client)
        except redis.AuthenticationError as exc:
            raise ValueError(f"redis_url: authentication failed for user {self.config.username or 'default'!r}: "
                             f"{exc}") from None
        except redis.ResponseError as exc:
            if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
                raise ValueError(f"redis_url: access refused by the server: {exc}") from None
            if not _unavailable(exc):
                raise
            self._reader.mark_down(exc)
        except down as exc:
            if isinstance(exc.__cause__, redis.AuthenticationError):  # a Cluster client wraps refused credentials
                raise ValueError(f"redis_url: authentication failed: {exc.__cause__}") from None
            self._reader.mark_down(exc)  # start degraded: serve from local tiers, keep trying

    def _probe_rights(self, client) -> None:
        """Run each command the index needs on probe keys under our prefix; refuse to start, naming
        what is missing, when the user lacks any (a '+ping'-only user used to start "up" and then
        fail every write in the background)."""
        redis = self._redis
        tag = f"{self._prefix}:{{nodes}}"
        s_key, h_key, set_key = f"{tag}:probe:{self.node_id}", f"{tag}:probeh:{self.node_id}", \
            f"{tag}:probes:{self.node_id}"
        steps = [
            ("SET", lambda p: p.set(s_key, "1", px=10_000, get=True)),
            ("GET", lambda p: p.get(s_key)),
            ("MGET", lambda p: p.mget([s_key])),
            ("HSET", lambda p: p.hset(h_key, self.node_id, "1")),
            ("HMGET", lambda p: p.hmget(h_key, [self.node_id])),
            ("HSCAN", lambda p: p.hscan(h_key, 0)),
            ("SADD", lambda p: p.sadd(set_key, "x")),
            ("SSCAN", lambda p: p.sscan(set_key, 0)),
            ("SREM", lambda p: p.srem(set_key, "x")),
            ("SCRIPT", lambda p: p.script_load(_UPSERT_LUA)),
            ("EVAL", lambda p: p.eval(_UPSERT_LUA, 1, s_key, self._me_field, bytes(48), ENTRY_BYTES, MAX_HOLDERS)),
            ("EVALSHA", lambda p: p.evalsha(_UPSERT_SHA, 1, s_key, self._me_field, bytes(48), ENTRY_BYTES,
                                            MAX_HOLDERS)),
            ("HDEL", lambda p: p.hdel(h_key, self.node_id)),
            ("DEL", lambda p: p.delete(s_key, h_key, set_key)),
        ]
        missing: List[str] = []
        for name, step in steps:
            try:
                step(client)
            except redis.exceptions.NoPermissionError as exc:
                missing.append(f"{name} ({exc})" if not missing else name)
            except redis.exceptions.NoScriptError:
                pass  # EVALSHA before the script was loaded: the right to run it is what was checked
            except redis.ResponseError as exc:
                if "NOPERM" in str(exc):
                    missing.append(name)
                elif _unavailable(exc):
                    raise
                else:
                    raise ValueError(f"redis_url: the server at {self.config.url} cannot run what the index "
                                     f"needs ({name}: {exc}); it needs Redis 6.2 or newer") from None
        if missing:
            user = self.config.username or "default"
            raise ValueError(f"redis_username: user {user!r} lacks permission for {', '.join(missing)} on keys "
                             f"{self._prefix}:*; grant e.g. 'ACL SETUSER {user} ~{self._prefix}:* +@read "
                             f"+@write +@scripting +ping'")

    @property
    def up(self) -> bool:
        """Whether lookups are being answered by Redis (writes have their own state, see health())."""
        return self._reader.up

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    # ---------------------------------------------------------------- keys
    def _page_key(self, root: bytes, key: bytes) -> str:
        return f"{self._prefix}:{{{root.hex()}}}:p:{key.hex()}"

    def _root_ptr_key(self, key: bytes) -> str:
        """Where a page's chain root is recorded (the page itself is the hash tag: one slot)."""
        return f"{self._prefix}:{{{key.hex()}}}:r"

    def _node_key(self, node: str) -> str:
        return f"{self._prefix}:{{nodes}}:n:{node}"

    def _owned_key(self, node: str) -> str:
        return f"{self._prefix}:{{o:{node}}}"

    def _pipeline(self, client):
        return client.pipeline(transaction=False) if not self.config.cluster else client.pipeline()

    # ---------------------------------------------------------------- interface
    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        if len(keys) != len(records):
            raise ValueError(f"publish: {len(keys)} keys but {len(records)} records")
        self._enqueue([("pub", (bytes(root), bytes(k), r)) for k, r in zip(keys, records)])

    def unpublish(self, keys: Sequence[bytes]) -> None:
        self._enqueue([("unpub", (bytes(k),)) for k in keys])

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]:
        """Leading run of `keys` (one chain under `root`) with live records; [] whenever Redis cannot answer.

        root=None: the caller does not know where the chain starts (SGLang's prefetch passes only the
        anchor node's ancestors, or nothing, as prefix keys); the root is read from the first key's
        root pointer first. Round trips: one MGET with a known root, a GET and an MGET without
        one, plus one MGET of heartbeats when the liveness cache (min(1 s, heartbeat_s)) is stale."""
        chain = self._chain(root, keys, exclude_self)
        if chain is None:
            return []
        return chain.records(self.config.lookup_max_holders)

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes], namespace: str) -> List[LocationTuple]:
        """The fast path of `lookup` for a reader of tier-3 namespace `namespace`: per page of the
        leading run, one location another live node holds there (decoded in bulk, no per-record
        objects). Same round trips as lookup()."""
        chain = self._chain(root, keys, True)
        return [] if chain is None else chain.locations(namespace)

    def _chain(self, root: Optional[bytes], keys: Sequence[bytes], exclude_self: bool) -> Optional[PageHolders]:
        if not keys:
            return None
        self._count("lookups")
        try:
            if root is None:
                found = self._reader.call(lambda c: c.get(self._root_ptr_key(bytes(keys[0]))), build=False,
                                          chain=True)
                if found is None or len(found) != 16:
                    return None  # nobody published the first page (or the pointer is foreign)
                root = bytes(found)
            pre = f"{self._prefix}:{{{bytes(root).hex()}}}:p:"
            values = self._reader.call(lambda c: self._fetch_values(c, pre, keys), build=False, chain=True)
            chain = PageHolders(values or [], exclude=self.node_id if exclude_self else "")
            if chain.rejected:
                self._count("rejected_records", chain.rejected)
                log.debug("radixtier: ignored %d index entries that do not make sense", chain.rejected)
            live = self._liveness(self._reader, chain.nodes)
            dead = chain.keep_nodes([live.get(n, False) for n in chain.nodes])
            if dead:
                self._count("dead_records_ignored", dead)
        except _ChainFailed:  # this chain's lookup failed, Redis still answers: nothing remote for it
            self._count("lookup_failures")
            self._count("chain_failures")
            return None
        except _Down:
            self._count("lookup_failures")
            return None
        except Exception as exc:  # e.g. WRONGTYPE on a foreign key: this chain is unanswerable, Redis is not down
            self._count("lookup_failures")
            log.debug("radixtier: prefix index lookup failed: %s", exc)
            return None
        return chain

    def _fetch_values(self, client, prefix: str, keys: Sequence[bytes]):
        """The chain's page values: one MGET of prefix + hex(key) (one slot: the names share the
        root's hash tag), packed in one pass where the keys allow (see packed_mget)."""
        command = mget_command(prefix.encode(), keys)
        if command is not None:
            try:
                return packed_mget(client, command, prefix + bytes(keys[0]).hex())
            except Redirected:
                pass
        return client.mget([prefix + bytes(k).hex() for k in keys])

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
        """`up`: lookups are answered; `writer_up`: publishes reach Redis; `access_denied`: the server's
        NOPERM answer while our user lacks a right (up and writer_up are then False as well)."""
        with self._lock:
            depth = len(self._queue)
        with self._counters_lock:
            counters = dict(self.counters)
        denied = self._reader.denied or self._writer.denied
        return {"up": self._reader.up and not self._reader.denied,
                "writer_up": self._writer.up and not self._writer.denied, "access_denied": denied,
                "queue_depth": depth, **counters}

    def close(self) -> None:
        if self._worker is not None:
            self.flush(timeout=2.0)
            self._stop.set()
            self._worker.join(timeout=5)
            try:
                self._writer.call(lambda c: c.delete(self._node_key(self.node_id)))  # dead from now on
            except Exception:
                pass
        self._reader.close()
        self._writer.close()

    # ---------------------------------------------------------------- the fleet, for operators
    def ensure_reachable(self) -> None:
        """Raise OSError naming the URL when Redis does not answer (an operator tool fails at once)."""
        try:
            self._writer.call(lambda c: c.ping())
        except _Down as exc:
            why = exc.__cause__ or "no answer"
            raise OSError(f"redis_url: {self.config.url} is not reachable: {why}") from None
    def fleet_status(self, check: bool = False, progress: Optional[Callable[[int], None]] = None) -> Dict[str, object]:
        """Every node ever seen: alive or dead with its last heartbeat, pages and chains it published,
        Redis memory its records take; check=True also reads each chain log and counts entries a
        lookup would reject. Read-only."""
        w = self._writer
        all_key = f"{self._prefix}:{{nodes}}:all"
        nodes: List[str] = []
        cursor = 0
        while True:
            cursor, members = w.call(lambda c, cur=cursor: c.sscan(all_key, cur, count=1000))
            nodes += [_text(m) for m in members]
            if cursor == 0:
                break
        nodes.sort()
        beats = w.call(lambda c: c.mget([self._node_key(n) for n in nodes])) if nodes else []
        last = w.call(lambda c: c.hmget(f"{self._prefix}:{{nodes}}:beats", nodes)) if nodes else []
        rows = []
        now = time.time()
        for node, beat, seen in zip(nodes, beats, last):
            owned = self._owned_key(node)
            roots: Dict[str, int] = {}
            pages: List[Tuple[str, str]] = []
            for key, root in w.call(lambda c, o=owned: list(c.hscan_iter(o, count=1000))):
                roots[_text(root)] = roots.get(_text(root), 0) + 1
                pages.append((_text(key), _text(root)))
            mem = self._memory_of(owned)
            if mem is not None:
                mem += len(pages) * ENTRY_BYTES  # its entries in the pages' shared values
            beat_at = _beat_time(beat) or _float(seen)
            row = {"node": node, "alive": beat is not None,
                   "last_heartbeat_s_ago": None if beat_at is None else round(max(0.0, now - beat_at), 1),
                   "pages": sum(roots.values()), "chains": len(roots), "redis_bytes": mem}
            if check:
                row["rejected_entries"] = self._count_bad_entries(node, pages)
            rows.append(row)
            if progress is not None:
                progress(1)
        info = w.call(lambda c: c.info("memory"))
        used = info.get("used_memory") if isinstance(info, dict) else None
        return {"url": self.config.url, "namespace": self.config.namespace, "key_prefix": self.config.key_prefix,
                "nodes": rows, "live": sum(1 for r in rows if r["alive"]), "dead": sum(1 for r in rows if not r["alive"]),
                "redis_used_memory_bytes": used}

    def _memory_of(self, owned: str) -> Optional[int]:
        """Bytes Redis reports for a node's owned-pages hash (MEMORY USAGE); None where refused."""
        try:
            v = self._writer.call(lambda c: c.memory_usage(owned))
            return int(v) if v is not None else 0
        except Exception:
            return None

    def _count_bad_entries(self, node: str, pages: List[Tuple[str, str]], batch: int = 1000) -> int:
        """Entries of `node` in its pages' values that a lookup would reject (or that are missing)."""
        field = node_field(node) if 0 < len(node.encode()) <= 48 else b""
        bad = 0
        for i in range(0, len(pages), batch):
            chunk = [(k, r) for k, r in pages[i:i + batch] if _is_hex(k, 32) and _is_hex(r, 32)]
            bad += len(pages[i:i + batch]) - len(chunk)

            def run(client, chunk=chunk):
                pipe = self._pipeline(client)
                for k, r in chunk:
                    pipe.get(f"{self._prefix}:{{{r}}}:p:{k}")
                return pipe.execute()

            for value in self._writer.call(run):
                holders = PageHolders([value or b""])
                mine = [j for j, n in enumerate(holders.nodes) if n == node] if field else []
                if not mine or holders.rejected:
                    bad += 1
        return bad

    def collect_all_garbage(self) -> int:
        """collect_garbage until the whole node set was walked once (an operator's `index gc`)."""
        removed = self.collect_garbage(max_nodes=1 << 30, wait_lock=True)
        return removed

    # ---------------------------------------------------------------- liveness
    def _liveness(self, link: _Link, nodes: Iterable[str]) -> Dict[str, bool]:
        """Alive or not, for just these nodes (those a lookup returned: at most pages x cap): one MGET of
        their heartbeats, cached for min(1 s, heartbeat_s). Never reads the whole node set, which
        anyone who can write to Redis could fill with millions of ids."""
        nodes = list(nodes)
        now = time.monotonic()
        ttl = min(1.0, self.config.heartbeat_s)
        with self._live_lock:
            need = [n for n in nodes if n not in self._live or now - self._live[n][1] >= ttl]
        if need:
            vals = link.call(lambda c: c.mget([self._node_key(n) for n in need]), chain=link is self._reader)
            with self._live_lock:
                for n, v in zip(need, vals):
                    self._live[n] = (v is not None, now)
                if len(self._live) > 4096:  # bounded: forget what is stale
                    self._live = {n: e for n, e in self._live.items() if now - e[1] < ttl}
        with self._live_lock:
            return {n: self._live.get(n, (False, 0.0))[0] for n in nodes}

    # ---------------------------------------------------------------- background work
    def _enqueue(self, ops: List[Tuple[str, tuple]]) -> None:
        with self._queue_cv:
            self._queue.extend(ops)
            over = len(self._queue) - self.config.publish_queue
            for _ in range(max(0, over)):  # bounded: the oldest go; re-publication reconciles what they changed
                self._queue.popleft()
            if over > 0:
                self._count("dropped_ops", over)
            self._queue_cv.notify_all()

    def _run(self) -> None:
        next_beat = 0.0
        next_gc = time.monotonic() + self.config.gc_interval_s
        w = self._writer
        while not self._stop.is_set():
            now = time.monotonic()
            if not w.up and now < w.down_until:
                self._stop.wait(min(0.05, w.down_until - now))
                continue
            try:
                if now >= next_beat or not w.up:  # after an outage the heartbeat goes first: it triggers republish
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
        payload = f"{cfg.node_id}|{time.time():.3f}|{uuid.uuid4().hex[:8]}"  # `index status` reads the time
        was_down = not self._writer.up

        def beat(client):
            pipe = self._pipeline(client)
            pipe.set(self._node_key(cfg.node_id), payload, px=int(cfg.node_ttl_s * 1000), get=True)
            pipe.sadd(f"{self._prefix}:{{nodes}}:all", cfg.node_id)
            pipe.hset(f"{self._prefix}:{{nodes}}:beats", cfg.node_id, f"{time.time():.3f}")  # outlives the TTL
            return pipe.execute()

        old, _, _ = self._writer.call(beat)
        if was_down:
            self._count("reconnects")
            log.warning("radixtier: prefix index %s reachable again; re-publishing local pages", cfg.url)
            self._need_republish = True
        if old is None:  # our heartbeat was gone: Redis restarted, or we were presumed dead
            self._need_republish = True
        self._probe_reader()

    def _probe_reader(self) -> None:
        """Bring lookups back without waiting for a request to find out that Redis is reachable again."""
        if not self._reader.up:
            try:
                self._reader.call(lambda c: c.ping())
            except Exception:
                pass

    def _republish(self) -> None:
        fn = self._republish_fn
        self._need_republish = False
        if fn is None:
            return
        held = [(bytes(root), bytes(key), rec) for root, key, rec in fn()]
        saved = self._reconcile_owned({key for _, key, _ in held})
        # A page keeps the root it was published under: lookups ask there (a trailing sidecar window's
        # root is its sequence's first page, which the store's parent links cannot show).
        held = [(saved.get(key, root), key, rec) for root, key, rec in held]
        if held:
            self._count("republished", len(held))
            self._enqueue([("pub", entry) for entry in held])

    def _reconcile_owned(self, held: set, batch: int = 1000) -> Dict[bytes, bytes]:
        """Roots of our records for pages the store still holds; records of the pages it no longer
        holds are deleted (their unpublish may have been dropped from a full queue)."""
        owned = self._owned_key(self.node_id)
        items = self._writer.call(lambda c: list(c.hscan_iter(owned, count=batch)))
        saved: Dict[bytes, bytes] = {}
        stale: List[Tuple[str, str]] = []
        for k, r in items:
            key_hex, root_hex = _text(k), _text(r)
            try:
                key, root = bytes.fromhex(key_hex), bytes.fromhex(root_hex)
            except ValueError:
                key = root = b""
            if key in held:
                saved[key] = root
            else:
                stale.append((key_hex, root_hex))
        junk = [key_hex for key_hex, _root in stale if not _is_hex(key_hex, 32)]
        if junk:
            self._writer.call(lambda c: c.hdel(owned, *junk))
        for i in range(0, len(stale), batch):
            self._apply([("unpub", (bytes.fromhex(key_hex),)) for key_hex, _root in stale[i:i + batch]
                         if _is_hex(key_hex, 32)])
        if stale:
            self._count("stale_removed", len(stale))
            log.info("radixtier: removed %d index records of pages this node no longer holds", len(stale))
        return saved

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
            except Exception:  # e.g. a server error that is not an outage: retry a few times
                self._batch_failures += 1
                with self._queue_cv:
                    if self._batch_failures < _BATCH_RETRIES:
                        self._queue.extendleft(reversed(ops))
                    else:
                        self._batch_failures = 0
                        self._count("dropped_ops", len(ops))
                        log.error("radixtier: dropped %d index updates after %d failed attempts (re-publication "
                                  "after the next reconnection restores them)", len(ops), _BATCH_RETRIES)
                    self._inflight_ops = 0
                    self._queue_cv.notify_all()
                raise
            self._batch_failures = 0
            with self._queue_cv:
                self._inflight_ops = 0
                self._queue_cv.notify_all()

    def _script(self, client, name: str):
        """The writers' scripts, loaded on every primary before a pipeline names them by SHA (a
        Cluster pipeline cannot load them on the way; a restarted Redis forgets them, see _run_scripted)."""
        script = self._scripts.get(name)
        if script is None:
            script = client.register_script(_UPSERT_LUA if name == "upsert" else _REMOVE_LUA)
            client.script_load(script.script)
            self._scripts[name] = script
        return script

    def _run_scripts(self, client, calls: List[Tuple[str, str, list]]) -> list:
        """Run the writers' scripts (name, page key, args), pipelined where the client allows it
        (redis-py refuses scripts in a Cluster pipeline: there they run one by one, off the serving
        path). A server that lost the scripts (restart) gets them again and the calls run once more."""
        def once() -> list:
            if self.config.cluster:
                return [self._script(client, name)(keys=[key], args=args, client=client) for name, key, args in calls]
            pipe = self._pipeline(client)
            for name, key, args in calls:
                self._script(client, name)(keys=[key], args=args, client=pipe)
            return pipe.execute()

        if not calls:
            return []
        try:
            return once()
        except self._redis.exceptions.NoScriptError:
            self._scripts.clear()
            return once()

    def _apply(self, ops: List[Tuple[str, tuple]]) -> None:
        """One drained batch: each op sets or removes our entry in one page's value (a script per
        page, pipelined). An unpublished page's owned entry goes only once its value no longer holds
        us: a batch that fails half-way (OOM, a shard down) is retried with its roots intact."""
        me = self.node_id
        owned = self._owned_key(me)
        roots = self._published_roots([args[0] for kind, args in ops if kind == "unpub"])
        steps: List[Tuple[str, bytes, Optional[bytes]]] = []  # (kind, key, root) in order
        for kind, args in ops:
            if kind == "pub":
                root, key, _rec = args
                roots[key] = root  # a later unpublish in this batch must find this record
                steps.append(("pub", key, root))
            else:
                steps.append(("unpub", args[0], roots.pop(args[0], None)))

        calls: List[Tuple[str, str, list]] = []
        for (kind, key, root), (_k, args) in zip(steps, ops):
            if kind == "pub":
                calls.append(("upsert", self._page_key(root, key),
                              [self._me_field, encode_record(args[2]), ENTRY_BYTES, MAX_HOLDERS]))
            elif root is not None:
                calls.append(("remove", self._page_key(root, key), [self._me_field, ENTRY_BYTES]))

        def run(client):
            replies = self._run_scripts(client, calls)
            pipe = self._pipeline(client)
            for kind, key, root in steps:
                if kind == "pub":
                    # a page's root is a function of its content (chained hashes), the same for every
                    # node: the pointer is never wrong, only possibly stale, so it just expires
                    pipe.set(self._root_ptr_key(key), root, ex=_ROOT_PTR_TTL_S)
                    pipe.hset(owned, key.hex(), root.hex())
            pipe.execute()
            return replies

        replies = iter(self._writer.call(run))
        last: Dict[bytes, Tuple[str, object]] = {}  # key -> (its last op in this batch, that op's reply)
        for kind, key, root in steps:
            last[key] = (kind, next(replies) if kind == "pub" or root is not None else None)
        unpub = [key for key, (kind, _r) in last.items() if kind == "unpub"]
        orphans = [key for key in unpub if not last[key][1]]  # nobody holds it now (or it was never ours)
        if unpub:
            self._writer.call(lambda c: c.hdel(owned, *[key.hex() for key in unpub]))
        if orphans:
            self._writer.call(lambda c: self._delete_keys(c, [self._root_ptr_key(k) for k in orphans]))
        n_pub = sum(1 for k, _ in ops if k == "pub")
        self._count("published", n_pub)
        self._count("unpublished", len(ops) - n_pub)

    def _delete_keys(self, client, names: List[str]):
        pipe = self._pipeline(client)  # one DEL per key: in a Cluster they sit in different slots
        for name in names:
            pipe.delete(name)
        return pipe.execute()

    def _published_roots(self, keys: List[bytes]) -> Dict[bytes, bytes]:
        """Roots under which `keys` were published (from our owned-pages hash), for unpublishing them."""
        if not keys:
            return {}
        vals = self._writer.call(lambda c: c.hmget(self._owned_key(self.node_id), [k.hex() for k in keys]))
        return {k: bytes.fromhex(_text(v)) for k, v in zip(keys, vals) if v}

    def collect_garbage(self, max_nodes: int = 2000, wait_lock: bool = False) -> int:
        """Remove records of nodes whose heartbeat expired (one collector at a time); returns records removed.

        Walks the node set with SSCAN, at most `max_nodes` ids per call (continuing where the last
        call stopped), so a set inflated with junk ids is cleaned up over several passes instead of
        stalling the worker."""
        lock = f"{self._prefix}:{{nodes}}:gc"
        all_key = f"{self._prefix}:{{nodes}}:all"
        w = self._writer
        deadline = time.monotonic() + (self.config.gc_interval_s + 1 if wait_lock else 0)
        while not w.call(lambda c: c.set(lock, self.node_id, nx=True, px=int(self.config.gc_interval_s * 1000))):
            if time.monotonic() >= deadline:
                return 0
            time.sleep(0.2)  # another collector holds the lock: an operator's gc waits its turn
        removed, seen, cursor = 0, 0, self._gc_cursor
        while True:
            cursor, members = w.call(lambda c, cur=cursor: c.sscan(all_key, cur, count=500))
            nodes = [n for n in (_text(m) for m in members) if n != self.node_id]
            seen += len(members)
            if nodes:
                beats = w.call(lambda c: c.mget([self._node_key(n) for n in nodes]))
                dead = [n for n, b in zip(nodes, beats) if b is None]
                if dead:
                    removed += self._collect_dead(dead)
            if cursor == 0 or seen >= max_nodes:
                break
        self._gc_cursor = cursor
        self._count("gc_removed", removed)
        return removed

    def _collect_dead(self, nodes: List[str]) -> int:
        """Records of dead nodes removed: nodes that published nothing go in one pipeline."""
        all_key = f"{self._prefix}:{{nodes}}:all"

        def exists(client):
            pipe = self._pipeline(client)
            for n in nodes:
                pipe.exists(self._owned_key(n))
            return pipe.execute()

        has = self._writer.call(exists)
        idle = [n for n, h in zip(nodes, has) if not h]
        if idle:
            self._writer.call(lambda c: c.srem(all_key, *idle))
            self._writer.call(lambda c: c.hdel(f"{self._prefix}:{{nodes}}:beats", *idle))
        return sum(self._collect_node(n) for n, h in zip(nodes, has) if h)

    def _collect_node(self, node: str, batch: int = 1000) -> int:
        owned = self._owned_key(node)
        items = self._writer.call(lambda c: list(c.hscan_iter(owned, count=batch)))
        pairs = [(_text(k), _text(r)) for k, r in items if _is_hex(_text(k), 32) and _is_hex(_text(r), 32)]
        field = node_field(node) if 0 < len(node.encode()) <= 48 else None
        for i in range(0, len(pairs) if field is not None else 0, batch):
            chunk = pairs[i:i + batch]

            left = self._writer.call(lambda c, chunk=chunk: self._run_scripts(
                c, [("remove", f"{self._prefix}:{{{r}}}:p:{k}", [field, ENTRY_BYTES]) for k, r in chunk]))
            orphans = [bytes.fromhex(k) for (k, _r), n in zip(chunk, left) if not n]
            if orphans:
                self._writer.call(lambda c, o=orphans: self._delete_keys(c, [self._root_ptr_key(k) for k in o]))

        def forget(client):
            pipe = self._pipeline(client)
            pipe.delete(owned)
            pipe.srem(f"{self._prefix}:{{nodes}}:all", node)
            pipe.hdel(f"{self._prefix}:{{nodes}}:beats", node)
            return pipe.execute()

        self._writer.call(forget)
        return len(items)
