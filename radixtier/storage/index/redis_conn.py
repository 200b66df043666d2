"""Connections of the prefix index: clients, their up/down states with backoff, and how replies and
server errors are read.

Owns each Redis client the index builds (`Link`: one client with its own up/down state; `Pinger`:
the client that checks liveness after a slow lookup), how a client is built from the config
(`connect`), and the classification every part shares: what is an outage (`Down`), what is one
chain's own failure (`ChainFailed`), which server answers mean "not now" (`unavailable`) or "a key
of the wrong type" (`wrong_type`). Why a room of its own: lookups, publishing, liveness and the
operator tools all run through these, and none of them should decide on its own what "down" means.

Locks: a Link's `_build_lock` (held while a client connects) and its `_lock` (its state) are never
held together: marking a link down must never wait for a connect. Pinger's lock is a leaf.
"""

from __future__ import annotations

import logging
import threading
import time
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlparse

from radixtier.storage.index.redis_config import RedisIndexConfig

log = logging.getLogger("radixtier.storage.redis")

Client = Any  # redis.Redis or redis.cluster.RedisCluster (redis is imported only when an index is built)


class Down(Exception):
    """Redis cannot answer now (lost, backing off, or a "not now" server answer)."""


class ChainFailed(Exception):
    """One lookup failed (e.g. timed out on its chain) while the server still answers: not an outage."""


# Server answers that mean "not now" (failover, loading, a busy script, out of memory): back off as if
# the connection were lost, instead of raising into the caller or hammering the server.
UNAVAILABLE = frozenset({"CLUSTERDOWN", "MASTERDOWN", "TRYAGAIN", "READONLY", "BUSY", "OOM", "LOADING",
                         "NOAUTH", "WRONGPASS", "NOPERM"})


def unavailable(exc: BaseException) -> bool:
    """Whether a server error says Redis cannot serve now (redis-py strips the code off the message)."""
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return str(code).upper() in UNAVAILABLE


def wrong_type(exc: BaseException) -> bool:
    """Whether a server error says the key holds another type than the command needs."""
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return str(code).upper() == "WRONGTYPE" or str(exc).startswith("WRONGTYPE")


def text(v: object) -> str:
    """Text of a reply; bytes that are not UTF-8 never raise (they are untrusted data, not a bug)."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def node_name(raw: object) -> Optional[str]:
    """A node id as the registry holds it, or None when it is not UTF-8 (never one of ours)."""
    try:
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        return None


def is_hex(v: str, n: int) -> bool:
    return len(v) == n and all(c in "0123456789abcdef" for c in v)


def connect(cfg: RedisIndexConfig, redis: ModuleType, socket_timeout: float) -> Client:
    """A client for `cfg` with this socket timeout; no retries of redis-py's own (we back off ourselves).
    A Cluster client connects now: it may raise RedisClusterException."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: Dict[str, object] = dict(socket_timeout=socket_timeout, socket_connect_timeout=cfg.connect_timeout_s,
                                 health_check_interval=0, retry=Retry(NoBackoff(), 0))
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
    return redis.Redis.from_url(cfg.url, **kw)


def down_errors(redis: ModuleType) -> tuple:
    """Exceptions that mean the link is lost; a peer that stops speaking RESP mid-way is one too
    (InvalidResponse)."""
    from redis.exceptions import ClusterError, RedisClusterException

    return (redis.ConnectionError, redis.TimeoutError, OSError, RedisClusterException, ClusterError,
            redis.exceptions.InvalidResponse)


def pipeline(client: Client, cluster: bool) -> Any:
    """A pipeline without MULTI (a Cluster client's pipelines never have one)."""
    return client.pipeline(transaction=False) if not cluster else client.pipeline()


def delete_each(client: Client, names: List[str], cluster: bool) -> list:
    """One DEL per key, pipelined: in a Cluster they sit in different slots."""
    pipe = pipeline(client, cluster)
    for name in names:
        pipe.delete(name)
    return pipe.execute()


def answers_ping(client: Client) -> bool:
    """Whether `client` gets an answer to a PING (at its own socket timeout)."""
    try:
        return bool(client.ping())
    except Exception:
        return False


class Link:
    """One Redis client and its own up/down state, so a slow write batch never switches lookups off."""

    def __init__(self, name: str, url: str, connect: Callable[[], object], down_errors: tuple,
                 server_errors: tuple, backoff: Tuple[float, float], slow_errors: tuple = (),
                 answers: Optional[Callable[[object], bool]] = None) -> None:
        self.name, self.url = name, url
        self._slow_errors = slow_errors  # a reply that did not come in time: maybe just this call's
        self._answers = answers or answers_ping  # is the server up, after a slow call?
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

    def ensure_client(self) -> Client:
        """The client, built on first use: a Cluster client connects when built, and may not be able to yet."""
        client = self.client
        if client is None:
            with self._build_lock:  # not self._lock: marking down must never wait for a connect
                if self.client is None:
                    self.client = self._connect()
                client = self.client
        return client

    def call(self, fn: Callable[[Client], Any], build: bool = True, chain: bool = False) -> Any:
        """fn(client), or Down at once while backing off and whenever Redis cannot answer.

        build=False (lookups) never builds a missing client: building a Cluster client connects, which
        may take connect_timeout_s; the background worker builds it instead. chain=True (lookups): a
        timeout or lost connection is first checked with a PING; if the server answers, the failure
        was this call's own (a slow chain) and raises ChainFailed without switching the link off.
        """
        if not self.up and time.monotonic() < self.down_until:
            raise Down()
        client = None
        try:
            client = self.ensure_client() if build else self.client
            if client is None:
                raise Down()
            out = fn(client)
        except self._down_errors as exc:
            if chain and isinstance(exc, self._slow_errors) and client is not None and self._answers(client):
                raise ChainFailed() from exc
            self.mark_down(exc)
            raise Down() from exc
        except self._server_errors as exc:
            if unavailable(exc):
                if "NOPERM" in str(getattr(exc, "status_code", "") or "").upper() or \
                        type(exc).__name__ == "NoPermissionError":
                    self.denied = str(exc)
                self.mark_down(exc)
                raise Down() from exc
            raise
        if not self.up:
            self._mark_up()
        self.denied = ""
        return out

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


class Pinger:
    """Whether Redis answers a PING within the connect budget, after a lookup timed out.

    Why not the lookup's own budget: the value that made the lookup slow (a hostile 64 MiB
    value: Redis copies it into the reply, ~0.2 s on a loaded 2-core machine) holds up the
    server's event loop, and a PING queued behind it (on a fresh connection, whose handshake
    also waited at the lookup's socket timeout) missed the 50 ms, so one hostile chain
    switched lookups off for everyone. A server that answers within connect_timeout_s is up;
    a stalled one still fails within one lookup plus that budget. The PING goes through a
    client of its own with that socket timeout (connections kept, so no handshake each time).
    Cluster clients ping through redis-py (every node, at its socket timeout)."""

    def __init__(self, connect: Callable[[], object], cluster: bool) -> None:
        """connect: builds the liveness client (the lookups' settings, the connect budget as its
        socket timeout), on first use."""
        self._connect = connect
        self._cluster = cluster
        self._lock = threading.Lock()
        self._client = None

    def answers(self, client: Client) -> bool:
        """Link's `answers` check for lookups: `client` is the lookups' own (used only in a Cluster)."""
        if self._cluster:
            return answers_ping(client)
        try:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
                pinger = self._client
            return bool(pinger.ping())
        except Exception:
            return False

    def close(self) -> None:
        with self._lock:
            pinger, self._client = self._client, None
        if pinger is not None:
            pinger.close()
