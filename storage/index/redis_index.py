"""RedisPrefixIndex: which page hashes exist anywhere in the fleet, and where.

Key layout (prefix = "<key_prefix>:<namespace>"; root = the chain's page 0):

    <prefix>:{<root>}:p:<page>    STRING the page's holders: 96-byte entries (node id, NUL-padded to 48
                                  bytes, then its 48-byte record; at most 16, writers replace the oldest)
    <prefix>:{<page>}:r           STRING the page's root (for lookups that do not know where the chain starts)
    <prefix>:{nodes}:n:<node_id>  STRING with TTL: the node's heartbeat "node|unix time|token" (absent = dead;
                                  the token is random per process start: see identity.py)
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

Registry data is untrusted: anyone who can write to Redis can replace a key with another type or
add undecodable node ids. A key of the wrong type is replaced where it is ours to rebuild (the
node set, the heartbeat hash, our own heartbeat and pages hash, a GC lock nobody renews) and
skipped where it is not; each such problem is listed in health()["registry_problems"] and
logged at most once a minute, and publishing goes on meanwhile (it used to stall on every
heartbeat). One node id belongs to one live process: the heartbeat carries a token random per
process start, a start while another process renews our id's heartbeat is refused, and a
running node that finds another token in its heartbeat says so (health()["duplicate_node_id"]).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple
from urllib.parse import parse_qs, urlparse

from radixtier.storage import validate
from radixtier.storage.api import PageRecord, Republisher
from radixtier.storage.api import LocationTuple
from radixtier.storage.index.identity import beat_payload, beat_token, default_node_id, instance_token
from radixtier.storage.index.packed_mget import Redirected, mget_command, packed_mget
from radixtier.storage.index.records import (ENTRY_BYTES, MAX_HOLDERS, PageHolders, encode_record,
                                             node_field)

log = logging.getLogger("radixtier.storage.redis")

# Writers' scripts, one page (KEYS[1]) each, so a pipeline of them stays within a Cluster slot per
# chain. A value that is not whole entries, is oversized or is not a string at all is foreign: it is
# replaced (a GET of another type would fail the script, and with it the page, on every publish).
_UPSERT_LUA = """
local v = redis.pcall('GET', KEYS[1])
if type(v) ~= 'string' then v = '' end
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
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'table' then redis.call('DEL', KEYS[1]) return 0 end
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

_SCRIPTS = {"upsert": _UPSERT_LUA, "remove": _REMOVE_LUA}
_SHA = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in _SCRIPTS.items()}  # what EVALSHA names
_BATCH_RETRIES = 20  # a batch that fails this often in a row (not a connection loss) is dropped
_ROOT_PTR_TTL_S = 7 * 24 * 3600  # refreshed by every publish (and republish) of the page
_MAX_SECONDS = 86_400.0  # durations beyond a day are typos (1e308 overflowed socket timeouts and expiries)
_MAX_CLAIM_WAIT_S = 60.0  # the longest a start waits for a previous process's heartbeat to lapse
_LOG_EVERY_S = 60.0  # one log line per distinct problem per this many seconds
_PROBLEM_KEEP_S = 300.0  # health() lists problems seen this recently


@dataclass
class RedisIndexConfig:
    url: str = "redis://127.0.0.1:6379/0"
    node_id: str = field(default_factory=default_node_id)  # host name + machine/container tag (identity.py)
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
            _seconds(name, getattr(self, name))
        if self.write_timeout_s is not None:
            _seconds("write_timeout_s", self.write_timeout_s)
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


def _seconds(name: str, value: object) -> float:
    """A duration from just above 0 to a day: `1e308` passed the finite check and then overflowed
    the socket timeout (a traceback in the CLI) or the heartbeat's expiry."""
    seconds = validate.positive_seconds(name, value)
    if seconds > _MAX_SECONDS:
        raise ValueError(f"{name}: expected a positive number of seconds up to {_MAX_SECONDS:g}, got {value!r}")
    return seconds


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
    """Text of a reply; bytes that are not UTF-8 never raise (they are untrusted data, not a bug)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _name(raw) -> Optional[str]:
    """A node id as the registry holds it, or None when it is not UTF-8 (never one of ours)."""
    try:
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        return None


def _wrong_type(exc: BaseException) -> bool:
    """Whether a server error says the key holds another type than the command needs."""
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return str(code).upper() == "WRONGTYPE" or str(exc).startswith("WRONGTYPE")


class _Problems:
    """Problems met in registry data (kind "registry"), in our identity ("identity") and in the
    background work ("errors"), each logged at most once per _LOG_EVERY_S (a bad key met on every
    heartbeat used to log ~40 lines a second) and listed by health() while seen within the last
    _PROBLEM_KEEP_S."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: Dict[str, Tuple[str, str, float, float]] = {}  # what -> (kind, message, last seen, last logged)

    def note(self, what: str, message: str, level: int = logging.WARNING, kind: str = "registry") -> None:
        now = time.monotonic()
        with self._lock:
            logged = self._seen.get(what, ("", "", 0.0, -_LOG_EVERY_S))[3]
            due = now - logged >= _LOG_EVERY_S
            self._seen[what] = (kind, message, now, now if due else logged)
            if len(self._seen) > 256:  # bounded: forget the oldest
                del self._seen[min(self._seen, key=lambda w: self._seen[w][2])]
        if due:
            log.log(level, "radixtier: %s", message)

    def recent(self, kind: str) -> List[str]:
        """Messages of `kind` seen within _PROBLEM_KEEP_S, oldest first."""
        now = time.monotonic()
        with self._lock:
            items = sorted((at, m) for k, m, at, _l in self._seen.values() if k == kind and now - at < _PROBLEM_KEEP_S)
        return [m for _at, m in items]


class _Link:
    """One Redis client and its own up/down state, so a slow write batch never switches lookups off."""

    def __init__(self, name: str, url: str, connect: Callable[[], object], down_errors: tuple,
                 server_errors: tuple, backoff: Tuple[float, float], slow_errors: tuple = (),
                 answers: Optional[Callable[[object], bool]] = None) -> None:
        self.name, self.url = name, url
        self._slow_errors = slow_errors  # a reply that did not come in time: maybe just this call's
        self._answers = answers or self._answers_ping  # is the server up, after a slow call?
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
            if chain and isinstance(exc, self._slow_errors) and client is not None and self._answers(client):
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
        self._token = instance_token()  # in our heartbeat: another token there is another live process
        self._problems = _Problems()
        self._publish_error = ""  # the last drained batch's failure ("" once one succeeds)
        self._ping_client = None  # liveness checks after a slow lookup (see _answers_within_connect_budget)
        self._pinger_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self.counters = {"lookups": 0, "lookup_failures": 0, "chain_failures": 0, "rejected_records": 0,
                         "dead_records_ignored": 0,
                         "published": 0, "unpublished": 0, "dropped_ops": 0, "republished": 0, "reconnects": 0,
                         "gc_removed": 0, "stale_removed": 0, "publish_failures": 0, "registry_repairs": 0}
        # a peer that stops speaking RESP mid-way is treated as a lost link (InvalidResponse)
        down = (redis.ConnectionError, redis.TimeoutError, OSError, RedisClusterException, ClusterError,
                redis.exceptions.InvalidResponse)
        backoff = (cfg.backoff_initial_s, cfg.backoff_max_s)
        server = (redis.RedisError,)
        self._reader = _Link("lookups", cfg.url, lambda: self._connect(cfg.lookup_timeout_s), down, server, backoff,
                             slow_errors=(redis.TimeoutError,), answers=self._answers_within_connect_budget)
        self._writer = _Link("writes", cfg.url, lambda: self._connect(cfg.writer_timeout()), down, server, backoff)
        self._stop = threading.Event()
        self._need_republish = True
        self._worker: Optional[threading.Thread] = None
        try:
            self._check_access(down)
            if serve:
                self._claim()
        except BaseException:  # refused: nothing left behind (no connections, no heartbeat)
            self._reader.close()
            self._writer.close()
            raise
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
        """Refused credentials, or a server that is not Redis, are configuration errors; an
        unreachable Redis only starts us degraded."""
        redis = self._redis
        try:
            client = self._reader.ensure_client()
            self._ping_as_redis(client)
            self._probe_rights(client)
        except redis.AuthenticationError as exc:
            raise ValueError(f"redis_url: authentication failed for user {self.config.username or 'default'!r}: "
                             f"{exc}") from None
        except redis.exceptions.InvalidResponse as exc:  # before `down`: it is one of them at run time
            raise ValueError(self._not_redis(exc)) from None
        except redis.ResponseError as exc:
            if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
                raise ValueError(f"redis_url: access refused by the server: {exc}") from None
            if not _unavailable(exc):
                raise
            self._reader.mark_down(exc)
        except down as exc:
            if isinstance(exc.__cause__, redis.AuthenticationError):  # a Cluster client wraps refused credentials
                raise ValueError(f"redis_url: authentication failed: {exc.__cause__}") from None
            if isinstance(exc.__cause__, redis.exceptions.InvalidResponse):
                raise ValueError(self._not_redis(exc.__cause__)) from None
            self._reader.mark_down(exc)  # start degraded: serve from local tiers, keep trying

    def _ping_as_redis(self, client) -> None:
        """PING, raising InvalidResponse for a peer that does not speak RESP: redis-py meets such a
        peer with errors of its own parsing (a protocol error, or a handshake reply it indexes)."""
        redis = self._redis
        try:
            pong = client.ping()
        except (AttributeError, TypeError, IndexError, KeyError, UnicodeDecodeError) as exc:
            raise redis.exceptions.InvalidResponse(f"{type(exc).__name__}: {exc}") from None
        if pong is not True:  # e.g. a server that answers "+OK" to everything
            raise redis.exceptions.InvalidResponse(f"PING was answered with {pong!r}, not PONG")

    def _not_redis(self, exc: BaseException) -> str:
        return (f"redis_url: {self.config.url} did not answer as Redis ({exc}); is it the Redis port "
                f"(and rediss:// where the server wants TLS)?")

    def _probe_rights(self, client) -> None:
        """Run each command the index runs, the way it runs them, on probe keys under our prefix;
        refuse to start, naming what is missing, when the user lacks any (a '+ping'-only user, or
        one lacking a command only publishing ran, used to start "up" and then fail every write
        in the background). tests/test_index_access.py checks this list against the commands a
        node's whole life sends (INFO commandstats)."""
        redis = self._redis
        tag = f"{self._prefix}:{{nodes}}"
        s_key, h_key, set_key = f"{tag}:probe:{self.node_id}", f"{tag}:probeh:{self.node_id}", \
            f"{tag}:probes:{self.node_id}"
        steps = [
            ("SET", lambda c: c.set(s_key, "1", px=10_000, get=True)),
            ("GET", lambda c: c.get(s_key)),
            ("MGET", lambda c: c.mget([s_key])),
            ("EXISTS", lambda c: c.exists(s_key)),
            ("PTTL", lambda c: c.pttl(s_key)),
            ("DEL", lambda c: c.delete(f"{tag}:probed:{self.node_id}")),  # before the scripts, which run it too
            ("HSET", lambda c: c.hset(h_key, self.node_id, "1")),
            ("HMGET", lambda c: c.hmget(h_key, [self.node_id])),
            ("HSCAN", lambda c: c.hscan(h_key, 0)),
            ("SADD", lambda c: c.sadd(set_key, "x")),
            ("SSCAN", lambda c: c.sscan(set_key, 0)),
            ("SREM", lambda c: c.srem(set_key, "x")),
            ("SCRIPT LOAD", self._load_scripts),
            ("EVALSHA", lambda c: self._probe_scripts(c, s_key)),
            ("HDEL", lambda c: c.hdel(h_key, self.node_id)),
            ("DEL", lambda c: c.delete(s_key, h_key, set_key)),
        ]
        missing: List[str] = []
        for name, step in steps:
            try:
                step(client)
            except redis.exceptions.NoPermissionError as exc:
                missing.append(f"{name} ({exc})" if not missing else name)
            except redis.ResponseError as exc:
                if "NOPERM" in str(exc) or "can't run this command" in str(exc):  # the latter: inside a script
                    missing.append(f"{name} (what the script runs: {exc})" if not missing else name)
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

    def _probe_scripts(self, client, key: str) -> None:
        """The writers' scripts through the path publishing takes (_run_scripts), on a probe key;
        a server without them yet (NOSCRIPT) still proved the right to run EVALSHA."""
        calls = [("upsert", key, [self._me_field, bytes(48), ENTRY_BYTES, MAX_HOLDERS]),
                 ("remove", key, [self._me_field, ENTRY_BYTES])]
        for reply in self._run_scripts(client, calls, load=False):
            if isinstance(reply, Exception) and not isinstance(reply, self._redis.exceptions.NoScriptError):
                raise reply

    def _answers_within_connect_budget(self, client) -> bool:
        """Whether Redis answers a PING within the connect budget, after a lookup timed out.

        Why not the lookup's own budget: the value that made the lookup slow (a hostile 64 MiB
        value: Redis copies it into the reply, ~0.2 s on a loaded 2-core machine) holds up the
        server's event loop, and a PING queued behind it (on a fresh connection, whose handshake
        also waited at the lookup's socket timeout) missed the 50 ms, so one hostile chain
        switched lookups off for everyone. A server that answers within connect_timeout_s is up;
        a stalled one still fails within one lookup plus that budget. The PING goes through a
        client of its own with that socket timeout (connections kept, so no handshake each time).
        Cluster clients ping through redis-py (every node, at its socket timeout)."""
        if self.config.cluster:
            return _Link._answers_ping(client)
        try:
            return bool(self._pinger().ping())
        except Exception:
            return False

    def _pinger(self):
        """The liveness client (built on first use): the lookups' settings, the connect budget as
        its socket timeout."""
        with self._pinger_lock:
            if self._ping_client is None:
                budget = max(self.config.connect_timeout_s, self.config.lookup_timeout_s)
                self._ping_client = self._connect(budget)
            return self._ping_client

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

    def _all_key(self) -> str:
        return f"{self._prefix}:{{nodes}}:all"

    def _beats_key(self) -> str:
        return f"{self._prefix}:{{nodes}}:beats"

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
        """`up`: lookups are answered; `writer_up`: publishes reach Redis (False while the link is
        down, our user lacks a right, or the last batch failed: `last_publish_error`);
        `access_denied`: the server's NOPERM answer while our user lacks a right (up and writer_up
        are then False as well); `registry_problems`: bad registry data met in the last minutes
        (what was replaced or skipped); `duplicate_node_id`: another live process beats as our id;
        `recent_errors`: background failures of the last minutes (each also logged once a minute)."""
        with self._lock:
            depth = len(self._queue)
        with self._counters_lock:
            counters = dict(self.counters)
        denied = self._reader.denied or self._writer.denied
        duplicate = self._problems.recent("identity")
        publish_error = self._publish_error
        return {"up": self._reader.up and not self._reader.denied,
                "writer_up": self._writer.up and not self._writer.denied and not publish_error,
                "access_denied": denied, "last_publish_error": publish_error,
                "duplicate_node_id": duplicate[-1] if duplicate else "",
                "registry_problems": self.registry_problems(), "recent_errors": self._problems.recent("errors"),
                "queue_depth": depth, **counters}

    def registry_problems(self) -> List[str]:
        """Bad registry data met in the last minutes: what was replaced, skipped or only reported."""
        return self._problems.recent("registry")

    def close(self) -> None:
        if self._worker is not None:
            self.flush(timeout=2.0)
            self._stop.set()
            self._worker.join(timeout=5)
            try:
                self._writer.call(self._say_goodbye)  # dead from now on
            except Exception:
                pass
        self._reader.close()
        self._writer.close()
        with self._pinger_lock:
            pinger, self._ping_client = self._ping_client, None
        if pinger is not None:
            pinger.close()

    def _say_goodbye(self, client) -> None:
        """Delete our heartbeat, unless another process's now stands there (a duplicate's)."""
        key = self._node_key(self.node_id)
        if beat_token(client.get(key)) == self._token:
            client.delete(key)

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
        lookup would reject. Read-only: bad registry data (a key of the wrong type, an id that is
        not UTF-8) is listed under "problems" and the rest is reported as usual."""
        w, problems = self._writer, []
        members = self._read_node_set(problems)
        nodes = sorted(n for n in (_name(m) for m in members) if n is not None)
        junk = [m for m in members if _name(m) is None]
        if junk:
            problems.append(f"{self._all_key()}: {len(junk)} node id(s) that are not UTF-8, e.g. {junk[0]!r}; "
                            f"`radixtier index gc` removes them")
        beats = w.call(lambda c: c.mget([self._node_key(n) for n in nodes])) if nodes else []
        last = self._read_beats(nodes, problems)
        rows = []
        now = time.time()
        for node, beat, seen in zip(nodes, beats, last):
            rows.append(self._node_row(node, beat, seen, now, check, problems))
            if progress is not None:
                progress(1)
        used = self._used_memory()
        return {"url": self.config.url, "namespace": self.config.namespace, "key_prefix": self.config.key_prefix,
                "nodes": rows, "live": sum(1 for r in rows if r["alive"]), "dead": sum(1 for r in rows if not r["alive"]),
                "redis_used_memory_bytes": used, "problems": problems}

    def _read_node_set(self, problems: List[str]) -> List[bytes]:
        """The node set's members as stored (bytes); a node set of the wrong type is a problem."""
        all_key, out, cursor = self._all_key(), [], 0
        while True:
            try:
                cursor, members = self._writer.call(lambda c, cur=cursor: c.sscan(all_key, cur, count=1000))
            except self._redis.ResponseError as exc:
                if not _wrong_type(exc):
                    raise
                problems.append(f"{all_key}: not a set ({exc}): no node list; a running node or "
                                f"`radixtier index gc` replaces it")
                return []
            out += [m if isinstance(m, bytes) else str(m).encode() for m in members]
            if cursor == 0:
                return out

    def _read_beats(self, nodes: List[str], problems: List[str]) -> list:
        """Last heartbeat times of `nodes` from the heartbeat hash ([None]s where it is not a hash)."""
        try:  # read even without nodes: a bad hash is worth reporting
            return self._writer.call(lambda c: c.hmget(self._beats_key(), nodes or ["-"]))[:len(nodes)]
        except self._redis.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            problems.append(f"{self._beats_key()}: not a hash ({exc}): dead nodes' last heartbeats unknown; a "
                            f"running node or `radixtier index gc` replaces it")
            return [None] * len(nodes)

    def _node_row(self, node: str, beat, seen, now: float, check: bool, problems: List[str]) -> Dict[str, object]:
        owned = self._owned_key(node)
        roots: Dict[str, int] = {}
        pages: List[Tuple[str, str]] = []
        try:
            items = self._writer.call(lambda c: list(c.hscan_iter(owned, count=1000)))
        except self._redis.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            problems.append(f"{owned}: node {node!r}'s pages are not a hash ({exc}); "
                            f"{'the node replaces it' if beat is not None else '`radixtier index gc` removes it'}")
            items = []
        for key, root in items:
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
        return row

    def _used_memory(self) -> Optional[int]:
        """Redis's own used_memory (INFO memory); None where the user may not run INFO."""
        try:
            info = self._writer.call(lambda c: c.info("memory"))
        except (_Down, self._redis.RedisError):
            return None
        return info.get("used_memory") if isinstance(info, dict) else None

    def _memory_of(self, owned: str) -> Optional[int]:
        """Bytes Redis reports for a node's owned-pages hash (MEMORY USAGE); None where refused."""
        try:
            v = self._writer.call(lambda c: c.memory_usage(owned))
            return int(v) if v is not None else 0
        except Exception:
            return None

    def _count_bad_entries(self, node: str, pages: List[Tuple[str, str]], batch: int = 1000) -> int:
        """Entries of `node` in its pages' values that a lookup would reject (or that are missing;
        a value of the wrong type counts as one)."""
        field = node_field(node) if 0 < len(node.encode()) <= 48 else b""
        bad = 0
        for i in range(0, len(pages), batch):
            chunk = [(k, r) for k, r in pages[i:i + batch] if _is_hex(k, 32) and _is_hex(r, 32)]
            bad += len(pages[i:i + batch]) - len(chunk)

            def run(client, chunk=chunk):
                pipe = self._pipeline(client)
                for k, r in chunk:
                    pipe.get(f"{self._prefix}:{{{r}}}:p:{k}")
                return pipe.execute(raise_on_error=False)

            for value in self._writer.call(run):
                if isinstance(value, Exception):
                    if _unavailable(value):
                        raise value
                    bad += 1
                    continue
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
        """The worker: heartbeat, republication, publishing and GC, each its own step, so that one
        failing (a bad registry key used to fail the heartbeat on every loop, and nothing after it
        ran) never stops the others; an outage backs them all off (see _Link)."""
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
                ok = self._step(self._heartbeat)
                next_beat = now + self.config.heartbeat_s
            if self._need_republish and w.up:
                ok = self._step(self._republish) and ok
            if w.up:
                ok = self._step(self._drain) and ok
            if now >= next_gc and w.up:
                ok = self._step(self.collect_garbage) and ok
                next_gc = now + self.config.gc_interval_s
            if not ok:
                self._stop.wait(0.1)  # a failed step is retried, not spun on
                continue
            with self._queue_cv:
                if not self._queue and not self._stop.is_set():
                    self._queue_cv.wait(timeout=min(0.05, max(0.0, next_beat - time.monotonic())))

    def _step(self, fn: Callable[[], object]) -> bool:
        """One step of the worker; False when it failed (an outage, which the link backs off, or
        anything else, reported once a minute: never let the worker die)."""
        try:
            fn()
            return True
        except _Down:
            return False
        except Exception as exc:
            self._problems.note(f"worker:{type(exc).__name__}", f"prefix index worker error: {exc}", kind="errors")
            return False

    def _heartbeat(self) -> None:
        cfg = self.config
        payload = beat_payload(cfg.node_id, self._token, time.time())
        was_down = not self._writer.up
        node_key, all_key, beats_key = self._node_key(cfg.node_id), self._all_key(), self._beats_key()

        def beat(client):
            return self._pipe(client, [
                (node_key, lambda p: p.set(node_key, payload, px=int(cfg.node_ttl_s * 1000), get=True)),
                (all_key, lambda p: p.sadd(all_key, cfg.node_id)),
                (beats_key, lambda p: p.hset(beats_key, cfg.node_id, f"{time.time():.3f}")),  # outlives the TTL
            ])

        old, _, _ = self._writer.call(beat)
        if was_down:
            self._count("reconnects")
            log.warning("radixtier: prefix index %s reachable again; re-publishing local pages", cfg.url)
            self._need_republish = True
        if old is None:  # our heartbeat was gone: Redis restarted, or we were presumed dead
            self._need_republish = True
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
        return (f"node_id: {self.node_id!r} is in use by another live process{holder}; give each node its own "
                f"node_id (the SGLang plugin's extra_config key \"node_id\"), or stop the other process first")

    def _claim(self) -> None:
        """Take our node id's heartbeat, or refuse to start while another process renews it.

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
        except _Down:
            pass

    def _claim_with(self, client) -> None:
        """_claim's loop: SET NX our heartbeat; while another stands there, watch it (see _claim)."""
        cfg, key = self.config, self._node_key(self.node_id)
        ttl_ms = int(cfg.node_ttl_s * 1000)
        give_up = time.monotonic() + cfg.node_ttl_s + cfg.heartbeat_s
        seen: Optional[bytes] = None
        while not client.set(key, beat_payload(self.node_id, self._token, time.time()), nx=True, px=ttl_ms):
            now = self._tolerant(client, key, lambda c: c.get(key), None)  # a wrong type is no heartbeat
            if now is None:
                continue  # lapsed (or replaced) between the two calls
            if seen is not None and now != seen:
                raise ValueError(self._duplicate_message(beat_token(now)))
            if seen is None:
                seen, give_up = now, self._claim_deadline(client, key, give_up)
            if time.monotonic() >= give_up:
                client.set(key, beat_payload(self.node_id, self._token, time.time()), px=ttl_ms)
                self._problems.note(key, f"{key}: a heartbeat nobody renewed and that did not expire; taken over")
                return
            time.sleep(min(0.05, cfg.heartbeat_s / 4))

    def _claim_deadline(self, client, key: str, give_up: float) -> float:
        """How long to watch a heartbeat we found: our own node_ttl_s and heartbeat_s, or until it
        expires where its holder set a longer TTL (at most _MAX_CLAIM_WAIT_S)."""
        left_ms = client.pttl(key)
        give_up = max(give_up, time.monotonic() + min(max(left_ms, 0) / 1000, _MAX_CLAIM_WAIT_S))
        log.info("radixtier: node_id %r: waiting up to %.1f s for the heartbeat a previous process left to lapse",
                 self.node_id, give_up - time.monotonic())
        return give_up

    # ---------------------------------------------------------------- untrusted registry data
    def _pipe(self, client, ops: List[Tuple[str, Callable[[object], object]]], repair: bool = True) -> list:
        """Run ops (the key each touches, the call adding it to a pipeline) in one pipeline;
        replies in order. A key of the wrong type is replaced and its op run again (repair=True),
        or reported and answered None (repair=False: an operator's read-only view); other errors
        that are not an outage are reported and answered None. An outage raises (see _Link)."""
        pipe = self._pipeline(client)
        for _key, add in ops:
            add(pipe)
        replies = list(pipe.execute(raise_on_error=False))
        again, replaced = [], set()
        for i, ((key, add), reply) in enumerate(zip(ops, replies)):
            if isinstance(reply, Exception):
                if repair and _wrong_type(reply):
                    if key not in replaced:
                        self._replace(client, key, reply)
                        replaced.add(key)
                    again.append(i)
                else:
                    replies[i] = self._settle(key, reply)
        if again:
            redo = self._pipe(client, [ops[i] for i in again], repair=False)
            for i, reply in zip(again, redo):
                replies[i] = reply
        return replies

    def _settle(self, key: str, reply: Exception) -> None:
        """A failed reply of one op: an outage (or lost rights) is raised for the link to handle;
        anything else is reported (once a minute) and read as no answer."""
        if _unavailable(reply) or isinstance(reply, self._redis.exceptions.NoScriptError):
            raise reply
        bad_data = _wrong_type(reply)
        self._problems.note(f"{_text(key)}:{type(reply).__name__}", f"{_text(key)}: {reply}",
                            kind="registry" if bad_data else "errors")
        return None

    def _replace(self, client, key, why: BaseException) -> None:
        """Delete a key of ours that holds another type than we keep there: it is rebuilt by its
        next write (the node set and heartbeat hash on every heartbeat, our pages hash by the
        caller), and nothing in it could be read."""
        client.delete(key)
        self._count("registry_repairs")
        if key == self._owned_key(self.node_id):
            self._need_republish = True  # what it listed (for unpublish and GC) comes back from the store
        name = _text(key)
        self._problems.note(f"{name}:replaced", f"{name}: held the wrong type of value ({why}); replaced")

    def _tolerant(self, client, key, fn: Callable[[object], object], empty: object, repair: bool = True):
        """fn(client) on `key`; a key of the wrong type is replaced (or, repair=False, only
        reported) and `empty` returned, so one bad key never fails the work around it."""
        try:
            return fn(client)
        except self._redis.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            if repair:
                self._replace(client, key, exc)
            else:
                self._problems.note(f"{_text(key)}:wrong type", f"{_text(key)}: {exc}")
            return empty

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
        items = self._writer.call(lambda c: self._tolerant(c, owned, lambda c: list(c.hscan_iter(owned, count=batch)),
                                                           []))
        saved: Dict[bytes, bytes] = {}
        stale: List[bytes] = []  # 16-byte page keys
        junk: List[bytes] = []  # fields that are no page key at all (kept raw: they may not be UTF-8)
        for k, r in items:
            key_hex, root_hex = _text(k), _text(r)
            if not (_is_hex(key_hex, 32) and _is_hex(root_hex, 32)):
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
            self._apply([("unpub", (key,)) for key in stale[i:i + batch]])
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
            except Exception as exc:  # e.g. a server error that is not an outage: retry a few times
                self._batch_failures += 1
                self._publish_failed(exc)
                with self._queue_cv:
                    if self._batch_failures < _BATCH_RETRIES:
                        self._queue.extendleft(reversed(ops))
                    else:
                        self._batch_failures = 0
                        self._count("dropped_ops", len(ops))
                        self._problems.note("dropped", f"dropped {len(ops)} index updates after {_BATCH_RETRIES} "
                                            f"failed attempts (re-publication after the next reconnection restores "
                                            f"them)", level=logging.ERROR, kind="errors")
                    self._inflight_ops = 0
                    self._queue_cv.notify_all()
                raise
            self._batch_failures = 0
            self._publish_error = ""
            with self._queue_cv:
                self._inflight_ops = 0
                self._queue_cv.notify_all()

    def _publish_failed(self, exc: BaseException) -> None:
        """A drained batch failed without an outage: health() says so (writer_up False,
        last_publish_error) until a batch succeeds; logged once a minute."""
        self._count("publish_failures")
        self._publish_error = f"{type(exc).__name__}: {exc}"
        self._problems.note("publish", f"prefix index publish failed, retrying: {self._publish_error}",
                            kind="errors")

    def _load_scripts(self, client) -> None:
        """SCRIPT LOAD of the writers' scripts (on every primary of a Cluster): what a server
        without them (a restart, SCRIPT FLUSH) needs before EVALSHA finds them again."""
        for text in _SCRIPTS.values():
            client.script_load(text)

    def _run_scripts(self, client, calls: List[Tuple[str, str, list]], load: bool = True) -> list:
        """Run the writers' scripts (name, page key, args) by EVALSHA, pipelined where the client
        allows it (redis-py refuses scripts in a Cluster pipeline: there they run one by one, off
        the serving path); replies in order, a failed call's error in its place. A server that
        lacks the scripts gets them (SCRIPT LOAD) and the calls run once more (each is idempotent).
        Why not redis-py's Script objects: in a pipeline they send SCRIPT EXISTS before every
        batch, one more round trip and one more right the start check did not see."""
        if not calls:
            return []
        replies = self._evalsha(client, calls)
        if load and any(isinstance(r, self._redis.exceptions.NoScriptError) for r in replies):
            self._load_scripts(client)
            replies = self._evalsha(client, calls)
        return replies

    def _evalsha(self, client, calls: List[Tuple[str, str, list]]) -> list:
        if self.config.cluster:
            out: list = []
            for name, key, args in calls:
                try:
                    out.append(client.evalsha(_SHA[name], 1, key, *args))
                except self._redis.ResponseError as exc:
                    out.append(exc)
            return out
        pipe = self._pipeline(client)
        for name, key, args in calls:
            pipe.evalsha(_SHA[name], 1, key, *args)
        return list(pipe.execute(raise_on_error=False))

    def _script_replies(self, calls: List[Tuple[str, str, list]], replies: list) -> list:
        """Replies of _run_scripts with failures settled: an outage raises; a page whose script
        failed otherwise is reported and answered None (the rest of the batch stands)."""
        return [self._settle(key, r) if isinstance(r, Exception) else r for (_n, key, _a), r in zip(calls, replies)]

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
            replies = self._script_replies(calls, self._run_scripts(client, calls))
            writes: List[Tuple[str, Callable[[object], object]]] = []
            for kind, key, root in steps:
                if kind == "pub":
                    # a page's root is a function of its content (chained hashes), the same for every
                    # node: the pointer is never wrong, only possibly stale, so it just expires
                    ptr = self._root_ptr_key(key)
                    writes.append((ptr, lambda p, ptr=ptr, root=root: p.set(ptr, root, ex=_ROOT_PTR_TTL_S)))
                    writes.append((owned, lambda p, key=key, root=root: p.hset(owned, key.hex(), root.hex())))
            if writes:
                self._pipe(client, writes)  # a pages hash of the wrong type is replaced and written again
            return replies

        replies = iter(self._writer.call(run))
        last: Dict[bytes, Tuple[str, object]] = {}  # key -> (its last op in this batch, that op's reply)
        for kind, key, root in steps:
            last[key] = (kind, next(replies) if kind == "pub" or root is not None else None)
        unpub = [key for key, (kind, _r) in last.items() if kind == "unpub"]
        orphans = [key for key in unpub if not last[key][1]]  # nobody holds it now (or it was never ours)
        if unpub:
            self._writer.call(lambda c: self._tolerant(c, owned, lambda c: c.hdel(owned, *[k.hex() for k in unpub]),
                                                       0))
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
        owned = self._owned_key(self.node_id)
        vals = self._writer.call(lambda c: self._tolerant(c, owned, lambda c: c.hmget(owned, [k.hex() for k in keys]),
                                                          [None] * len(keys)))
        return {k: bytes.fromhex(_text(v)) for k, v in zip(keys, vals) if v and _is_hex(_text(v), 32)}

    def collect_garbage(self, max_nodes: int = 2000, wait_lock: bool = False) -> int:
        """Remove records of nodes whose heartbeat expired (one collector at a time); returns records removed.

        Walks the node set with SSCAN, at most `max_nodes` ids per call (continuing where the last
        call stopped), so a set inflated with junk ids is cleaned up over several passes instead of
        stalling the worker. Ids that are not UTF-8 (never a node's) are removed with what names them."""
        all_key = self._all_key()
        w = self._writer
        deadline = time.monotonic() + (self.config.gc_interval_s + 1 if wait_lock else 0)
        while not w.call(self._take_gc_lock):
            if time.monotonic() >= deadline:
                return 0
            time.sleep(0.2)  # another collector holds the lock: an operator's gc waits its turn
        removed, seen, cursor = 0, 0, self._gc_cursor
        while True:
            cursor, members = w.call(lambda c, cur=cursor: self._tolerant(
                c, all_key, lambda c: c.sscan(all_key, cur, count=500), (0, [])))
            names = [(m, _name(m)) for m in members]
            junk = [m for m, n in names if n is None]
            if junk:
                w.call(lambda c: self._forget_junk(c, junk))
            nodes = [n for _m, n in names if n is not None and n != self.node_id]
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

    def _take_gc_lock(self, client) -> bool:
        """The collectors' lock (SET NX with an expiry). A lock without an expiry, of any type, was
        not set by a collector and would stop collection for good: it is replaced."""
        lock = f"{self._prefix}:{{nodes}}:gc"
        if client.set(lock, self.node_id, nx=True, px=int(self.config.gc_interval_s * 1000)):
            return True
        if client.pttl(lock) == -1:  # exists, never expires
            self._replace(client, lock, ValueError("a lock without an expiry"))
            return bool(client.set(lock, self.node_id, nx=True, px=int(self.config.gc_interval_s * 1000)))
        return False

    def _forget_junk(self, client, members: List[bytes]) -> None:
        """Node ids in the node set that are not UTF-8: no node has one (ids are text), so they
        are removed with their heartbeat stamps and any pages hash under their name."""
        prefix = self._prefix.encode()
        self._pipe(client, [(self._all_key(), lambda p: p.srem(self._all_key(), *members)),
                            (self._beats_key(), lambda p: p.hdel(self._beats_key(), *members))]
                   + [(prefix + b":{o:" + m + b"}", lambda p, m=m: p.delete(prefix + b":{o:" + m + b"}"))
                      for m in members])
        shown = ", ".join(repr(m)[:60] for m in members[:3])
        self._problems.note("junk-node-ids", f"{self._all_key()}: node ids that are not UTF-8 ({shown}"
                                             f"{', ...' if len(members) > 3 else ''}); removed")

    def _collect_dead(self, nodes: List[str]) -> int:
        """Records of dead nodes removed: nodes that published nothing go in one pipeline."""
        has = self._writer.call(lambda c: self._pipe(c, [(self._owned_key(n), lambda p, n=n: p.exists(
            self._owned_key(n))) for n in nodes]))
        idle = [n for n, h in zip(nodes, has) if not h]
        if idle:
            self._writer.call(lambda c: self._pipe(c, [(self._all_key(), lambda p: p.srem(self._all_key(), *idle)),
                                                       (self._beats_key(), lambda p: p.hdel(self._beats_key(), *idle))]))
        return sum(self._collect_node(n) for n, h in zip(nodes, has) if h)

    def _collect_node(self, node: str, batch: int = 1000) -> int:
        owned = self._owned_key(node)
        items = self._writer.call(lambda c: self._tolerant(c, owned, lambda c: list(c.hscan_iter(owned, count=batch)),
                                                           []))
        pairs = [(_text(k), _text(r)) for k, r in items if _is_hex(_text(k), 32) and _is_hex(_text(r), 32)]
        field = node_field(node) if 0 < len(node.encode()) <= 48 else None
        for i in range(0, len(pairs) if field is not None else 0, batch):
            chunk = pairs[i:i + batch]
            calls = [("remove", f"{self._prefix}:{{{r}}}:p:{k}", [field, ENTRY_BYTES]) for k, r in chunk]
            left = self._writer.call(lambda c, calls=calls: self._script_replies(calls, self._run_scripts(c, calls)))
            orphans = [bytes.fromhex(k) for (k, _r), n in zip(chunk, left) if n == 0]
            if orphans:
                self._writer.call(lambda c, o=orphans: self._delete_keys(c, [self._root_ptr_key(k) for k in o]))
        self._writer.call(lambda c: self._pipe(c, [(owned, lambda p: p.delete(owned)),
                                                   (self._all_key(), lambda p: p.srem(self._all_key(), node)),
                                                   (self._beats_key(), lambda p: p.hdel(self._beats_key(), node))]))
        return len(items)
