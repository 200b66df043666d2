"""The plugin's settings, read from `--hicache-storage-backend-extra-config`.

Every key is checked here, once, at start-up: an operator who mistypes a key or a value
gets an error naming it, instead of a backend that silently runs with defaults.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

from radixtier.eviction import EVICTION_MODES, LEAVES_FIRST
from radixtier.storage.io_engine import ENGINES
from radixtier.units import parse_size

# Keys SGLang itself reads from the same JSON object; accepted and left to SGLang.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "hicache_storage_pass_prefix_keys",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "tp_lcm_size",
})
VERIFY_MODES = ("auto", "none", "headers", "full")
SSL_CERT_REQS = ("required", "optional", "none")



class ConfigError(ValueError):
    """A bad key or value in the extra config; the message names it."""


@dataclass
class BackendConfig:
    """What `RadixTierStorage` needs; defaults suit one node with a file namespace and no Redis."""

    path: str = ""                      # namespace: block device (/dev/nvme1n1) or a file
    capacity: int = 0                   # bytes; creates (formats) a file namespace that does not exist yet
    partitions: int = 8                 # partitions when creating: one per writer (node x TP/PP rank)
    partition: int = 0                  # this node's first partition; rank r writes partition + r
    page_bytes: int = 0                 # slot size; 0 = the largest page of the registered host pools
    node_id: str = field(default_factory=lambda: socket.gethostname().split(".")[0] or "node")
    redis_url: str = ""                 # empty: no cross-node index (pages of this node only)
    redis_username: Optional[str] = None
    redis_password: Optional[str] = None
    redis_namespace: str = "sglang"
    redis_key_prefix: str = "radixtier"
    redis_cluster: bool = False
    lookup_timeout_s: float = 0.05
    connect_timeout_s: float = 0.2
    heartbeat_s: float = 1.0
    node_ttl_s: float = 5.0
    ssl_ca_certs: Optional[str] = None
    ssl_certfile: Optional[str] = None
    ssl_keyfile: Optional[str] = None
    ssl_cert_reqs: str = "required"
    io_engine: str = "auto"
    queue_depth: int = 16
    direct: bool = True
    sync: bool = True
    verify: str = "auto"
    eviction: str = LEAVES_FIRST
    coalesce_bytes: int = 1 << 20
    lease_s: float = 15.0               # partition lease on the device; renewed every lease_s / 4
    force_takeover: bool = False        # take a partition whose lease another host still renews

    @classmethod
    def keys(cls) -> frozenset:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> "BackendConfig":
        """Parse and check SGLang's extra_config dict; raises ConfigError naming the first bad key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"hicache-storage-backend-extra-config: expected a JSON object, got "
                              f"{type(extra).__name__}")
        known = cls.keys()
        for key in extra:
            if not isinstance(key, str):
                raise ConfigError(f"extra_config: keys must be strings, got {key!r}")
            if key not in known and key not in SGLANG_KEYS:
                near = difflib.get_close_matches(key, sorted(known | SGLANG_KEYS), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"extra_config: unknown key {key!r}{hint} (radixtier keys: "
                                  f"{', '.join(sorted(known))})")
        cfg = cls()
        values: Dict[str, Any] = {k: v for k, v in extra.items() if k in known}
        for name, raw in values.items():
            setattr(cfg, name, _coerce(name, raw, getattr(cfg, name)))
        cfg.check()
        return cfg

    def check(self) -> None:
        if not self.path:
            raise ConfigError("path: required: the NVMe-oF namespace (e.g. /dev/nvme1n1) or a file on it")
        for name in ("partitions", "queue_depth", "coalesce_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        for name in ("capacity", "partition", "page_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected a non-negative integer, got {getattr(self, name)!r}")
        if self.page_bytes and self.page_bytes % 512:
            raise ConfigError(f"page_bytes: expected a multiple of 512, got {self.page_bytes}")
        if not self.node_id or len(self.node_id.encode()) > 40 or re.search(r"[{}:\s]", self.node_id):
            raise ConfigError(f"node_id: expected 1-40 bytes without braces, colons or spaces, got {self.node_id!r}")
        if self.redis_url and not re.match(r"^(redis|rediss|unix)://", self.redis_url):
            raise ConfigError(f"redis_url: expected redis://, rediss:// or unix://, got {self.redis_url!r}")
        for name in ("lookup_timeout_s", "connect_timeout_s", "heartbeat_s", "node_ttl_s", "lease_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:  # nan compares false with everything; inf never times out
                raise ConfigError(f"{name}: expected a positive, finite number of seconds, got {v!r}")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ConfigError(f"node_ttl_s: must exceed heartbeat_s ({self.heartbeat_s}), got {self.node_ttl_s}")
        for name, allowed in (("io_engine", ENGINES), ("verify", VERIFY_MODES), ("eviction", EVICTION_MODES),
                              ("ssl_cert_reqs", SSL_CERT_REQS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: expected one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("redis_namespace", "redis_key_prefix"):
            v = getattr(self, name)
            if not v or "{" in v or "}" in v:
                raise ConfigError(f"{name}: expected a non-empty string without braces, got {v!r}")
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            v = getattr(self, name)
            if v and not os.path.isfile(v):  # fail the launch, not the first TLS handshake
                raise ConfigError(f"{name}: {v} does not exist or is not a file")


def _size(name: str, raw: Any) -> int:
    """4096, '256KiB', '4MiB', '2TB' -> bytes."""
    if isinstance(raw, bool) or not isinstance(raw, (int, str, float)):
        raise ConfigError(f"{name}: expected a size in bytes (e.g. 4096 or '10GiB'), got {raw!r}")
    if raw == 0 or raw == "0":  # capacity 0: do not create; page_bytes 0: the pools' largest page
        return 0
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


_SIZES = {"capacity", "page_bytes", "coalesce_bytes"}


def _coerce(name: str, raw: Any, default: Any) -> Any:
    """JSON value -> the field's type, refusing anything that would need a guess."""
    if name in _SIZES:
        return _size(name, raw)
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        if raw in (0, 1) and isinstance(raw, int):
            return bool(raw)
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}: expected true or false, got {raw!r}")
    if isinstance(default, int):
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise ConfigError(f"{name}: expected an integer, got {raw!r}")
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if isinstance(default, float):
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ConfigError(f"{name}: expected a number, got {raw!r}")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
        if not math.isfinite(value):  # "nan" slips past every comparison; "inf" never times out
            raise ConfigError(f"{name}: expected a finite number, got {raw!r}")
        return value
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ConfigError(f"{name}: expected a string, got {raw!r}")
    return raw
