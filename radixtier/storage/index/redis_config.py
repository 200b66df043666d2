"""RedisIndexConfig: every setting of the Redis prefix index, and the checks that refuse bad ones.

Owns the settings users configure (through the SGLang plugin's extra_config, the CLI's options or
the Python API) and their one-line errors. Why a room of its own: the plugin's configuration and
the CLI parse and check these without connecting to anything, so nothing here imports redis.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Optional
from urllib.parse import parse_qs, urlparse

from radixtier import validate
from radixtier.storage.index.identity import default_node_id

MAX_SECONDS = 86_400.0  # durations beyond a day are typos (1e308 overflowed socket timeouts and expiries)


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
            seconds(name, getattr(self, name))
        if self.write_timeout_s is not None:
            seconds("write_timeout_s", self.write_timeout_s)
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


def seconds(name: str, value: object) -> float:
    """A duration from just above 0 to a day: `1e308` passed the finite check and then overflowed
    the socket timeout (a traceback in the CLI) or the heartbeat's expiry."""
    value_s = validate.positive_seconds(name, value)
    if value_s > MAX_SECONDS:
        raise ValueError(f"{name}: expected a positive number of seconds up to {MAX_SECONDS:g}, got {value!r}")
    return value_s
