"""The plugin's settings, read from `--hicache-storage-backend-extra-config`.

Every key is checked here, once, at start-up: an operator who mistypes a key or a value
gets an error naming it, instead of a backend that silently runs with defaults.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit

from radixtier import validate
from radixtier.storage.index.identity import default_node_id
from radixtier.storage.index.redis_index import RedisIndexConfig
from radixtier.storage.nvmeof.config import StoreConfig
from radixtier.storage.nvmeof.layout import MAX_PARTITIONS
from radixtier.storage.nvmeof.namespace import will_create
from radixtier.units import parse_size

# Keys SGLang itself reads from the same JSON object; accepted and left to SGLang.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "hicache_storage_pass_prefix_keys",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "tp_lcm_size",
})
# extra_config keys that configure the prefix index -> the RedisIndexConfig field each one sets.
# The index's settings have one type (RedisIndexConfig); these are only their names in SGLang's JSON.
REDIS_KEYS = {
    "redis_url": "url", "redis_username": "username", "redis_password": "password",
    "redis_namespace": "namespace", "redis_key_prefix": "key_prefix", "redis_cluster": "cluster",
    "lookup_timeout_s": "lookup_timeout_s", "connect_timeout_s": "connect_timeout_s",
    "heartbeat_s": "heartbeat_s", "node_ttl_s": "node_ttl_s", "ssl_ca_certs": "ssl_ca_certs",
    "ssl_certfile": "ssl_certfile", "ssl_keyfile": "ssl_keyfile", "ssl_cert_reqs": "ssl_cert_reqs",
    "lookup_max_holders": "lookup_max_holders",
}
_FIELD_KEY = {f: k for k, f in REDIS_KEYS.items()}
# extra_config keys that set the page store's StoreConfig: its own field names
STORE_KEYS = StoreConfig.keys()
NODE_ID_BASE_BYTES = validate.NODE_ID_MAX_BYTES - 8  # room for the ".r<rank>" suffix of multi-rank nodes
REDIS_URL_MAX_CHARS = 4096  # far past any real URL (a long ACL password included); a value this long is a mistake
SHOWN_CHARS = 64            # how much of a long value an error message echoes back
ZMQ_TRANSPORTS = ("tcp", "ipc", "inproc")  # where tier-3 KV events may be published
_HOST_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")  # one DNS label (underscores: container and compose names)


def _default_redis() -> RedisIndexConfig:
    """No Redis until redis_url is set; one key space per SGLang deployment by default."""
    return RedisIndexConfig(url="", namespace="sglang")


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
    node_id: str = field(default_factory=default_node_id)  # <host>-<8 hex of machine and container id>
    redis: RedisIndexConfig = field(default_factory=_default_redis)  # the REDIS_KEYS; url "" = no Redis
    store: StoreConfig = field(default_factory=StoreConfig)  # the STORE_KEYS: how the page store runs
    # tier-3 KV events in SGLang's wire format (kv_events.py): a ZMQ endpoint such as "tcp://*:5600"
    # ('' = off; its port is offset by the DP rank, as SGLang's own publisher's is)
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""  # optional ROUTER endpoint serving missed batches
    kv_events_topic: str = "radixtier"
    kv_events_token_wait_s: float = 2.0  # how long a backed-up page waits for SGLang to tell its tokens
    kv_events_heartbeat_s: float = 5.0  # an empty batch after this long without one (0 = none): late subscribers see the gap

    @classmethod
    def keys(cls) -> frozenset:
        return (frozenset(f.name for f in fields(cls) if f.name not in ("redis", "store")) | frozenset(REDIS_KEYS)
                | STORE_KEYS)

    @property
    def redis_url(self) -> str:
        """The prefix index's URL; empty: no cross-node index (this node's pages only)."""
        return self.redis.url

    def index_config(self, node_id: str) -> RedisIndexConfig:
        """The Redis index settings for one rank's identity."""
        return replace(self.redis, node_id=node_id)

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
        try:
            cfg = cls()
        except ValueError as exc:  # e.g. RADIXTIER_LEASE_IO_TIMEOUT_S too long for the default lease_s
            raise ConfigError(str(exc)) from None
        store_values = {}  # the store's settings are checked together, as one StoreConfig
        for name, raw in extra.items():
            if name in REDIS_KEYS:
                target = REDIS_KEYS[name]
                setattr(cfg.redis, target, _coerce(name, raw, getattr(cfg.redis, target)))
            elif name in STORE_KEYS:
                store_values[name] = _coerce(name, raw, getattr(cfg.store, name))
            elif name in known:
                setattr(cfg, name, _coerce(name, raw, getattr(cfg, name)))
        try:
            cfg.store = replace(cfg.store, **store_values)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cfg.check()
        cfg.check_room()
        return cfg

    def check(self) -> None:
        if not self.path:
            raise ConfigError("path: required: the NVMe-oF namespace (e.g. /dev/nvme1n1) or a file on it")
        for name in ("capacity", "partition", "page_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: expected a non-negative integer, got {getattr(self, name)!r}")
        if self.page_bytes and self.page_bytes % 512:
            raise ConfigError(f"page_bytes: expected a multiple of 512, got {self.page_bytes}")
        try:
            validate.positive_int("partitions", self.partitions, MAX_PARTITIONS)
            validate.node_id("node_id", self.node_id, NODE_ID_BASE_BYTES)
            validate.positive_seconds("kv_events_token_wait_s", self.kv_events_token_wait_s, 0.01, 600.0)
            if self.kv_events_heartbeat_s != 0:
                validate.positive_seconds("kv_events_heartbeat_s", self.kv_events_heartbeat_s, 0.1, 3600.0)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and (len(value) > SHOWN_CHARS * 4 or value.split("://", 1)[0] not in ZMQ_TRANSPORTS
                          or "://" not in value):
                raise ConfigError(f"{name}: expected a ZMQ endpoint ({', '.join(t + '://...' for t in ZMQ_TRANSPORTS)}"
                                  f", e.g. \"tcp://*:5600\"), got {_shown(value)}")
        if isinstance(self.redis.url, str) and self.redis.url:
            _check_redis_url(self.redis.url)
        try:
            self.index_config(self.node_id).validate(require_url=False)
        except ValueError as exc:  # named by the extra_config key, not the RedisIndexConfig field
            text = str(exc)
            if isinstance(self.redis.url, str) and len(self.redis.url) > SHOWN_CHARS:  # never echo a long URL whole
                text = text.replace(repr(self.redis.url), _shown_url(self.redis.url))
            field_name = text.split(":", 1)[0]
            key = _FIELD_KEY.get(field_name, field_name)
            raise ConfigError(key + text[len(field_name):]) from None

    def check_room(self) -> None:
        """A file namespace that `capacity` is about to create must fit the filesystem it goes on.

        Checked here, before any folder or file exists, because the store finds out too late: a
        size past the filesystem's largest file fails its ftruncate with a bare `[Errno 27] File
        too large`, and a size past the free space fails its fallocate after the file was made.
        Reads the filesystem (statvfs) and creates nothing; an existing namespace keeps the size
        it was formatted with, so capacity is not checked against it."""
        if not self.capacity or not will_create(self.path):
            return
        folder = _nearest_folder(self.path)
        try:
            st = os.statvfs(folder)
        except OSError as exc:
            raise ConfigError(f"capacity: cannot read the free space of {folder} to create {self.path} "
                              f"({exc.strerror})") from None
        room = st.f_bavail * st.f_frsize
        if self.capacity > room:
            raise ConfigError(f"capacity: expected at most {room} bytes ({room / (1 << 30):.1f} GiB free on the "
                              f"filesystem holding {folder}), got {shown_size(self.capacity)}")


def _nearest_folder(path: str) -> str:
    """The folder `path` would be created in, or its nearest existing ancestor (attach makes the rest)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def shown_size(nbytes: int) -> str:
    """A size as an operator writes it: 4000TiB when a binary unit divides it, else bytes."""
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def _shown(value: str) -> str:
    """repr of a string value for an error line, cut to SHOWN_CHARS with its full length said."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def _shown_url(url: str) -> str:
    """_shown of a URL with its password, if any, replaced by ***: error lines end up in shared logs."""
    return _shown(re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url, count=1))


def _check_redis_url(url: str) -> None:
    """Length, host and port of redis_url, checked at start-up: redis-py would otherwise fail on the
    first connection, deep inside (a 64-character DNS label is an idna UnicodeError from socket),
    after the namespace was already created, and its error would echo the whole URL."""
    if len(url) > REDIS_URL_MAX_CHARS:
        raise ConfigError(f"redis_url: expected a URL of at most {REDIS_URL_MAX_CHARS} characters, got "
                          f"{_shown_url(url)}")
    if url.split(":", 1)[0].lower() not in ("redis", "rediss"):
        return  # unix:// has no host; any other scheme is refused, by name, with the index's other settings
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a bad port or a bracketed host that is no IPv6 address
        what = "a port from 1 to 65535" if "port" in str(exc).lower() else "a host name or IP address"
        raise ConfigError(f"redis_url: expected {what}, got {_shown_url(url)} ({exc})") from None
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"redis_url: expected a port from 1 to 65535, got {port} in {_shown_url(url)}")
    if host and not _valid_host(host):
        raise ConfigError(f"redis_url: expected a host name (labels of 1-63 letters, digits, '-' or '_', "
                          f"253 characters in all) or an IP address, got host {_shown(host)}")


def _valid_host(host: str) -> bool:
    """An IP address, or a DNS name (international names as their ASCII form) that resolvers take."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        name = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    return len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)


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
