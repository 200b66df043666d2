"""Operator tools over a prefix index's Redis (`radixtier index status|gc`): the fleet's state and
a full garbage collection.

Owns the read-only fleet report (every node ever seen: alive or dead with its last heartbeat,
pages and chains it published, Redis memory its records take, optionally the entries a lookup
would reject) and the operator's whole-set collection. Why a room of its own: only the CLI (and
tests) use these; the serving path (RedisPrefixIndex, the SGLang integration, the embedded cache)
must never load this module. Each function works on an index opened with serve=False through its
public surface (config, the writes' link, collect_garbage); nothing here holds state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import redis

from radixtier.storage.index.records import ENTRY_BYTES, PageHolders, node_field
from radixtier.storage.index.redis_conn import (Client, Down, Link, is_hex, node_name, pipeline, text, unavailable,
                                                wrong_type)
from radixtier.storage.index.redis_keys import Keys

if TYPE_CHECKING:
    from radixtier.storage.index.redis_index import RedisPrefixIndex


def ensure_reachable(index: RedisPrefixIndex) -> None:
    """Raise OSError naming the URL when Redis does not answer (an operator tool fails at once)."""
    try:
        index.writes.call(lambda c: c.ping())
    except Down as exc:
        why = exc.__cause__ or "no answer"
        raise OSError(f"redis_url: {index.config.url} is not reachable: {why}") from None


def collect_all_garbage(index: RedisPrefixIndex) -> int:
    """collect_garbage until the whole node set was walked once (an operator's `index gc`)."""
    return index.collect_garbage(max_nodes=1 << 30, wait_lock=True)


def fleet_status(index: RedisPrefixIndex, check: bool = False,
                 progress: Optional[Callable[[int], None]] = None) -> Dict[str, object]:
    """Every node ever seen: alive or dead with its last heartbeat, pages and chains it published,
    Redis memory its records take; check=True also reads each chain log and counts entries a
    lookup would reject. Read-only: bad registry data (a key of the wrong type, an id that is
    not UTF-8) is listed under "problems" and the rest is reported as usual."""
    cfg = index.config
    fleet = _Fleet(index.writes, Keys(cfg.key_prefix, cfg.namespace), cfg.cluster)
    w, problems = index.writes, []
    members = fleet.read_node_set(problems)
    nodes = sorted(n for n in (node_name(m) for m in members) if n is not None)
    junk = [m for m in members if node_name(m) is None]
    if junk:
        problems.append(f"{fleet.keys.node_set}: {len(junk)} node id(s) that are not UTF-8, e.g. {junk[0]!r}; "
                        f"`radixtier index gc` removes them")
    beats = w.call(lambda c: c.mget([fleet.keys.node(n) for n in nodes])) if nodes else []
    last = fleet.read_beats(nodes, problems)
    rows = []
    now = time.time()
    for node, beat, seen in zip(nodes, beats, last):
        rows.append(fleet.node_row(node, beat, seen, now, check, problems))
        if progress is not None:
            progress(1)
    used = fleet.used_memory()
    return {"url": cfg.url, "namespace": cfg.namespace, "key_prefix": cfg.key_prefix,
            "nodes": rows, "live": sum(1 for r in rows if r["alive"]), "dead": sum(1 for r in rows if not r["alive"]),
            "redis_used_memory_bytes": used, "problems": problems}


def _beat_time(beat: object) -> Optional[float]:
    """When a heartbeat was written (its payload is node|unix time|nonce), or None."""
    try:
        return float(text(beat).rsplit("|", 2)[1])
    except (IndexError, ValueError, TypeError, AttributeError):
        return None


def _float(v: object) -> Optional[float]:
    try:
        return float(text(v)) if v is not None else None
    except ValueError:
        return None


class _Fleet:
    """The reads of one fleet report, through the writes' link (never repairing: read-only)."""

    def __init__(self, link: Link, keys: Keys, cluster: bool) -> None:
        self.link, self.keys, self.cluster = link, keys, cluster

    def read_node_set(self, problems: List[str]) -> List[bytes]:
        """The node set's members as stored (bytes); a node set of the wrong type is a problem."""
        all_key, out, cursor = self.keys.node_set, [], 0
        while True:
            try:
                cursor, members = self.link.call(lambda c, cur=cursor: c.sscan(all_key, cur, count=1000))
            except redis.ResponseError as exc:
                if not wrong_type(exc):
                    raise
                problems.append(f"{all_key}: not a set ({exc}): no node list; a running node or "
                                f"`radixtier index gc` replaces it")
                return []
            out += [m if isinstance(m, bytes) else str(m).encode() for m in members]
            if cursor == 0:
                return out

    def read_beats(self, nodes: List[str], problems: List[str]) -> list:
        """Last heartbeat times of `nodes` from the heartbeat hash ([None]s where it is not a hash)."""
        beats_key = self.keys.beats
        try:  # read even without nodes: a bad hash is worth reporting
            return self.link.call(lambda c: c.hmget(beats_key, nodes or ["-"]))[:len(nodes)]
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            problems.append(f"{beats_key}: not a hash ({exc}): dead nodes' last heartbeats unknown; a "
                            f"running node or `radixtier index gc` replaces it")
            return [None] * len(nodes)

    def node_row(self, node: str, beat: Optional[bytes], seen: Optional[bytes], now: float, check: bool,
                 problems: List[str]) -> Dict[str, object]:
        owned = self.keys.owned(node)
        roots: Dict[str, int] = {}
        pages: List[Tuple[str, str]] = []
        try:
            items = self.link.call(lambda c: list(c.hscan_iter(owned, count=1000)))
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            problems.append(f"{owned}: node {node!r}'s pages are not a hash ({exc}); "
                            f"{'the node replaces it' if beat is not None else '`radixtier index gc` removes it'}")
            items = []
        for key, root in items:
            roots[text(root)] = roots.get(text(root), 0) + 1
            pages.append((text(key), text(root)))
        mem = self.memory_of(owned)
        if mem is not None:
            mem += len(pages) * ENTRY_BYTES  # its entries in the pages' shared values
        beat_at = _beat_time(beat) or _float(seen)
        row = {"node": node, "alive": beat is not None,
               "last_heartbeat_s_ago": None if beat_at is None else round(max(0.0, now - beat_at), 1),
               "pages": sum(roots.values()), "chains": len(roots), "redis_bytes": mem}
        if check:
            row["rejected_entries"] = self.count_bad_entries(node, pages)
        return row

    def used_memory(self) -> Optional[int]:
        """Redis's own used_memory (INFO memory); None where the user may not run INFO."""
        try:
            info = self.link.call(lambda c: c.info("memory"))
        except (Down, redis.RedisError):
            return None
        return info.get("used_memory") if isinstance(info, dict) else None

    def memory_of(self, owned: str) -> Optional[int]:
        """Bytes Redis reports for a node's owned-pages hash (MEMORY USAGE); None where refused."""
        try:
            v = self.link.call(lambda c: c.memory_usage(owned))
            return int(v) if v is not None else 0
        except Exception:
            return None

    def count_bad_entries(self, node: str, pages: List[Tuple[str, str]], batch: int = 1000) -> int:
        """Entries of `node` in its pages' values that a lookup would reject (or that are missing;
        a value of the wrong type counts as one)."""
        field = node_field(node) if 0 < len(node.encode()) <= 48 else b""
        bad = 0
        for i in range(0, len(pages), batch):
            chunk = [(k, r) for k, r in pages[i:i + batch] if is_hex(k, 32) and is_hex(r, 32)]
            bad += len(pages[i:i + batch]) - len(chunk)

            def run(client: Client, chunk: List[Tuple[str, str]] = chunk) -> list:
                pipe = pipeline(client, self.cluster)
                for k, r in chunk:
                    pipe.get(self.keys.page_hex(r, k))
                return pipe.execute(raise_on_error=False)

            for value in self.link.call(run):
                if isinstance(value, Exception):
                    if unavailable(value):
                        raise value
                    bad += 1
                    continue
                holders = PageHolders([value or b""])
                mine = [j for j, n in enumerate(holders.nodes) if n == node] if field else []
                if not mine or holders.rejected:
                    bad += 1
        return bad
