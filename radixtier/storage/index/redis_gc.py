"""Garbage collection of the prefix index: records of nodes whose heartbeat expired.

Owns the collectors' lock (one collector at a time, fleet-wide) and this node's place in its walk
of the node set (an SSCAN cursor, continued by the next pass). Every serving node's worker
collects now and then (gc_interval_s); an operator's `radixtier index gc` runs the same collector
over the whole set. Why a room of its own: it is the only code that deletes other nodes' records,
and it must survive a node set that anyone who can write to Redis may have filled with junk.
The cursor is the worker's alone (or the operator tool's); no locks.
"""

from __future__ import annotations

import time
from typing import List

from radixtier.storage.index.records import ENTRY_BYTES, node_field
from radixtier.storage.index.redis_conn import Client, Link, delete_each, is_hex, node_name, text
from radixtier.storage.index.redis_health import Counters, Problems
from radixtier.storage.index.redis_keys import Keys
from radixtier.storage.index.redis_repair import Repair
from radixtier.storage.index.redis_scripts import ScriptRunner


class Collector:
    """Removes dead nodes' records, a bounded slice of the node set per pass."""

    def __init__(self, writer: Link, keys: Keys, node_id: str, gc_interval_s: float, cluster: bool,
                 scripts: ScriptRunner, repair: Repair, counters: Counters, problems: Problems) -> None:
        self._writer, self._keys, self._node_id = writer, keys, node_id
        self._gc_interval_s, self._cluster = gc_interval_s, cluster
        self._scripts, self._repair = scripts, repair
        self._counters, self._problems = counters, problems
        self._cursor = 0

    def collect(self, max_nodes: int = 2000, wait_lock: bool = False) -> int:
        """Remove records of nodes whose heartbeat expired (one collector at a time); returns records removed.

        Walks the node set with SSCAN, at most `max_nodes` ids per call (continuing where the last
        call stopped), so a set inflated with junk ids is cleaned up over several passes instead of
        stalling the worker. Ids that are not UTF-8 (never a node's) are removed with what names them."""
        all_key = self._keys.node_set
        w, repair = self._writer, self._repair
        deadline = time.monotonic() + (self._gc_interval_s + 1 if wait_lock else 0)
        while not w.call(self._take_lock):
            if time.monotonic() >= deadline:
                return 0
            time.sleep(0.2)  # another collector holds the lock: an operator's gc waits its turn
        removed, seen, cursor = 0, 0, self._cursor
        while True:
            cursor, members = w.call(lambda c, cur=cursor: repair.tolerant(
                c, all_key, lambda c: c.sscan(all_key, cur, count=500), (0, [])))
            names = [(m, node_name(m)) for m in members]
            junk = [m for m, n in names if n is None]
            if junk:
                w.call(lambda c: self._forget_junk(c, junk))
            nodes = [n for _m, n in names if n is not None and n != self._node_id]
            seen += len(members)
            if nodes:
                beats = w.call(lambda c: c.mget([self._keys.node(n) for n in nodes]))
                dead = [n for n, b in zip(nodes, beats) if b is None]
                if dead:
                    removed += self._collect_dead(dead)
            if cursor == 0 or seen >= max_nodes:
                break
        self._cursor = cursor
        self._counters.add("gc_removed", removed)
        return removed

    def _take_lock(self, client: Client) -> bool:
        """The collectors' lock (SET NX with an expiry). A lock without an expiry, of any type, was
        not set by a collector and would stop collection for good: it is replaced."""
        lock, px = self._keys.gc_lock, int(self._gc_interval_s * 1000)
        if client.set(lock, self._node_id, nx=True, px=px):
            return True
        if client.pttl(lock) == -1:  # exists, never expires
            self._repair.replace(client, lock, ValueError("a lock without an expiry"))
            return bool(client.set(lock, self._node_id, nx=True, px=px))
        return False

    def _forget_junk(self, client: Client, members: List[bytes]) -> None:
        """Node ids in the node set that are not UTF-8: no node has one (ids are text), so they
        are removed with their heartbeat stamps and any pages hash under their name."""
        all_key, beats_key = self._keys.node_set, self._keys.beats
        self._repair.pipe(client, [(all_key, lambda p: p.srem(all_key, *members)),
                                   (beats_key, lambda p: p.hdel(beats_key, *members))]
                          + [(self._keys.owned_raw(m), lambda p, m=m: p.delete(self._keys.owned_raw(m)))
                             for m in members])
        shown = ", ".join(repr(m)[:60] for m in members[:3])
        self._problems.note("junk-node-ids", f"{all_key}: node ids that are not UTF-8 ({shown}"
                                             f"{', ...' if len(members) > 3 else ''}); removed")

    def _collect_dead(self, nodes: List[str]) -> int:
        """Records of dead nodes removed: nodes that published nothing go in one pipeline."""
        keys, repair = self._keys, self._repair
        has = self._writer.call(lambda c: repair.pipe(c, [(keys.owned(n), lambda p, n=n: p.exists(keys.owned(n)))
                                                          for n in nodes]))
        idle = [n for n, h in zip(nodes, has) if not h]
        if idle:
            self._writer.call(lambda c: repair.pipe(c, [(keys.node_set, lambda p: p.srem(keys.node_set, *idle)),
                                                        (keys.beats, lambda p: p.hdel(keys.beats, *idle))]))
        return sum(self._collect_node(n) for n, h in zip(nodes, has) if h)

    def _collect_node(self, node: str, batch: int = 1000) -> int:
        keys, repair, w = self._keys, self._repair, self._writer
        owned = keys.owned(node)
        items = w.call(lambda c: repair.tolerant(c, owned, lambda c: list(c.hscan_iter(owned, count=batch)), []))
        pairs = [(text(k), text(r)) for k, r in items if is_hex(text(k), 32) and is_hex(text(r), 32)]
        field = node_field(node) if 0 < len(node.encode()) <= 48 else None
        for i in range(0, len(pairs) if field is not None else 0, batch):
            chunk = pairs[i:i + batch]
            calls = [("remove", keys.page_hex(r, k), [field, ENTRY_BYTES]) for k, r in chunk]
            left = w.call(lambda c, calls=calls: repair.script_replies(calls, self._scripts.run(c, calls)))
            orphans = [bytes.fromhex(k) for (k, _r), n in zip(chunk, left) if n == 0]
            if orphans:
                w.call(lambda c, o=orphans: delete_each(c, [keys.root_ptr(k) for k in o], self._cluster))
        w.call(lambda c: repair.pipe(c, [(owned, lambda p: p.delete(owned)),
                                         (keys.node_set, lambda p: p.srem(keys.node_set, node)),
                                         (keys.beats, lambda p: p.hdel(keys.beats, node))]))
        return len(items)
