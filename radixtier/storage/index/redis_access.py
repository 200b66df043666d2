"""The start's checks of a Redis server: is it Redis, do our credentials work, does our user hold
every right the index will use.

Owns the one-line configuration errors of a start (refused credentials, a server that is not
Redis, missing ACL rights, a server too old for the commands) and the probe that finds them by
running each command the index runs, the way it runs them. Why a room of its own: these errors
belong to the start alone, while an unreachable Redis only starts the index degraded; the serving
path never comes back here. Stateless: it works on the link and the config it is given.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, List, Tuple

from radixtier.storage.index.records import ENTRY_BYTES, MAX_HOLDERS, node_field
from radixtier.storage.index.redis_config import RedisIndexConfig
from radixtier.storage.index.redis_conn import Client, Link, unavailable
from radixtier.storage.index.redis_keys import Keys
from radixtier.storage.index.redis_scripts import ScriptRunner, load_scripts


def not_redis(url: str, exc: BaseException) -> str:
    """The error of a peer that did not answer as Redis."""
    return (f"redis_url: {url} did not answer as Redis ({exc}); is it the Redis port "
            f"(and rediss:// where the server wants TLS)?")


def check_access(link: Link, cfg: RedisIndexConfig, keys: Keys, redis: ModuleType, scripts: ScriptRunner,
                 down: tuple) -> None:
    """Refused credentials, or a server that is not Redis, are configuration errors (ValueError);
    an unreachable Redis only starts us degraded (`link` marked down)."""
    try:
        client = link.ensure_client()
        ping_as_redis(redis, client)
        probe_rights(client, cfg, keys, redis, scripts)
    except redis.AuthenticationError as exc:
        raise ValueError(f"redis_url: authentication failed for user {cfg.username or 'default'!r}: "
                         f"{exc}") from None
    except redis.exceptions.InvalidResponse as exc:  # before `down`: it is one of them at run time
        raise ValueError(not_redis(cfg.url, exc)) from None
    except redis.ResponseError as exc:
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in str(exc):
            raise ValueError(f"redis_url: access refused by the server: {exc}") from None
        if not unavailable(exc):
            raise
        link.mark_down(exc)
    except down as exc:
        if isinstance(exc.__cause__, redis.AuthenticationError):  # a Cluster client wraps refused credentials
            raise ValueError(f"redis_url: authentication failed: {exc.__cause__}") from None
        if isinstance(exc.__cause__, redis.exceptions.InvalidResponse):
            raise ValueError(not_redis(cfg.url, exc.__cause__)) from None
        link.mark_down(exc)  # start degraded: serve from local tiers, keep trying


def ping_as_redis(redis: ModuleType, client: Client) -> None:
    """PING, raising InvalidResponse for a peer that does not speak RESP: redis-py meets such a
    peer with errors of its own parsing (a protocol error, or a handshake reply it indexes)."""
    try:
        pong = client.ping()
    except (AttributeError, TypeError, IndexError, KeyError, UnicodeDecodeError) as exc:
        raise redis.exceptions.InvalidResponse(f"{type(exc).__name__}: {exc}") from None
    if pong is not True:  # e.g. a server that answers "+OK" to everything
        raise redis.exceptions.InvalidResponse(f"PING was answered with {pong!r}, not PONG")


def probe_rights(client: Client, cfg: RedisIndexConfig, keys: Keys, redis: ModuleType,
                 scripts: ScriptRunner) -> None:
    """Run each command the index runs, the way it runs them, on probe keys under our prefix;
    refuse to start, naming what is missing, when the user lacks any (a '+ping'-only user, or
    one lacking a command only publishing ran, used to start "up" and then fail every write
    in the background). tests/test_index_access.py checks this list against the commands a
    node's whole life sends (INFO commandstats)."""
    node, tag = cfg.node_id, keys.nodes_tag
    s_key, h_key, set_key = f"{tag}:probe:{node}", f"{tag}:probeh:{node}", f"{tag}:probes:{node}"
    steps: List[Tuple[str, Callable[[object], object]]] = [
        ("SET", lambda c: c.set(s_key, "1", px=10_000, get=True)),
        ("GET", lambda c: c.get(s_key)),
        ("MGET", lambda c: c.mget([s_key])),
        ("EXISTS", lambda c: c.exists(s_key)),
        ("PTTL", lambda c: c.pttl(s_key)),
        ("DEL", lambda c: c.delete(f"{tag}:probed:{node}")),  # before the scripts, which run it too
        ("HSET", lambda c: c.hset(h_key, node, "1")),
        ("HMGET", lambda c: c.hmget(h_key, [node])),
        ("HSCAN", lambda c: c.hscan(h_key, 0)),
        ("SADD", lambda c: c.sadd(set_key, "x")),
        ("SSCAN", lambda c: c.sscan(set_key, 0)),
        ("SREM", lambda c: c.srem(set_key, "x")),
        ("SCRIPT LOAD", load_scripts),
        ("EVALSHA", lambda c: probe_scripts(c, node, s_key, scripts)),
        ("HDEL", lambda c: c.hdel(h_key, node)),
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
            elif unavailable(exc):
                raise
            else:
                raise ValueError(f"redis_url: the server at {cfg.url} cannot run what the index "
                                 f"needs ({name}: {exc}); it needs Redis 6.2 or newer") from None
    if missing:
        user = cfg.username or "default"
        raise ValueError(f"redis_username: user {user!r} lacks permission for {', '.join(missing)} on keys "
                         f"{keys.prefix}:*; grant e.g. 'ACL SETUSER {user} ~{keys.prefix}:* +@read "
                         f"+@write +@scripting +ping'")


def probe_scripts(client: Client, node: str, key: str, scripts: ScriptRunner) -> None:
    """The writers' scripts through the path publishing takes (ScriptRunner.run), on a probe key;
    a server without them yet (NOSCRIPT) still proved the right to run EVALSHA."""
    me = node_field(node)
    calls = [("upsert", key, [me, bytes(48), ENTRY_BYTES, MAX_HOLDERS]),
             ("remove", key, [me, ENTRY_BYTES])]
    for reply in scripts.run(client, calls, load=False):
        if isinstance(reply, Exception) and not scripts.is_no_script(reply):
            raise reply
