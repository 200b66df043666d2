"""Lookups of the prefix index: which nodes hold the pages of a chain, on the serving path.

Owns the read side: one MGET of a chain's packed page values (decoded in bulk by PageHolders, see
records.py), the root pointer for callers that do not know where a chain starts, and the cache
of which holders are alive (their heartbeats, read for just the nodes a lookup returned). Why a
room of its own: this is the only code a request waits on, with its own client and up/down state
(a slow write batch never switches lookups off), and it must stay small and fast: no per-page
Python objects beyond what the caller reads.

Lookups wait at most `lookup_timeout_s`; while Redis is down they answer "nothing remote" at once.
Lock: `_live_lock` is a leaf, held for dict updates only, never during I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from radixtier.storage.api import LocationTuple, PageRecord
from radixtier.storage.index.packed_mget import Redirected, mget_command, packed_mget
from radixtier.storage.index.records import PageHolders
from radixtier.storage.index.redis_conn import ChainFailed, Client, Down, Link
from radixtier.storage.index.redis_health import Counters
from radixtier.storage.index.redis_keys import Keys

log = logging.getLogger("radixtier.storage.redis")


class Lookups:
    """Chain lookups through the lookups' link (never building its client: the worker does)."""

    def __init__(self, reader: Link, keys: Keys, node_id: str, max_holders: int, heartbeat_s: float,
                 counters: Counters) -> None:
        self._reader, self._keys, self._node_id = reader, keys, node_id
        self._max_holders = max_holders
        self._live_ttl = min(1.0, heartbeat_s)
        self._count = counters.add
        self._live: Dict[str, Tuple[bool, float]] = {}  # node -> (alive, when read); bounded, see alive()
        self._live_lock = threading.Lock()

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]:
        """See RedisPrefixIndex.lookup."""
        chain = self.chain(root, keys, exclude_self)
        if chain is None:
            return []
        return chain.records(self._max_holders)

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes], namespace: str) -> List[LocationTuple]:
        """See RedisPrefixIndex.lookup_locations."""
        chain = self.chain(root, keys, True)
        return [] if chain is None else chain.locations(namespace)

    def chain(self, root: Optional[bytes], keys: Sequence[bytes], exclude_self: bool) -> Optional[PageHolders]:
        """The live holders of the leading run of `keys`, or None when nothing can be said (no keys,
        no root pointer, Redis down, this chain's lookup failed)."""
        if not keys:
            return None
        self._count("lookups")
        try:
            if root is None:
                found = self._reader.call(lambda c: c.get(self._keys.root_ptr(bytes(keys[0]))), build=False,
                                          chain=True)
                if found is None or len(found) != 16:
                    return None  # nobody published the first page (or the pointer is foreign)
                root = bytes(found)
            pre = self._keys.chain_prefix(bytes(root))
            values = self._reader.call(lambda c: self.fetch_values(c, pre, keys), build=False, chain=True)
            chain = PageHolders(values or [], exclude=self._node_id if exclude_self else "")
            if chain.rejected:
                self._count("rejected_records", chain.rejected)
                log.debug("radixtier: ignored %d index entries that do not make sense", chain.rejected)
            live = self.alive(chain.nodes)
            dead = chain.keep_nodes([live.get(n, False) for n in chain.nodes])
            if dead:
                self._count("dead_records_ignored", dead)
        except ChainFailed:  # this chain's lookup failed, Redis still answers: nothing remote for it
            self._count("lookup_failures")
            self._count("chain_failures")
            return None
        except Down:
            self._count("lookup_failures")
            return None
        except Exception as exc:  # e.g. WRONGTYPE on a foreign key: this chain is unanswerable, Redis is not down
            self._count("lookup_failures")
            log.debug("radixtier: prefix index lookup failed: %s", exc)
            return None
        return chain

    def fetch_values(self, client: Client, prefix: str, keys: Sequence[bytes]) -> list:
        """The chain's page values: one MGET of prefix + hex(key) (one slot: the names share the
        root's hash tag), packed in one pass where the keys allow (see packed_mget)."""
        command = mget_command(prefix.encode(), keys)
        if command is not None:
            try:
                return packed_mget(client, command, prefix + bytes(keys[0]).hex())
            except Redirected:
                pass
        return client.mget([prefix + bytes(k).hex() for k in keys])

    def alive(self, nodes: Iterable[str]) -> Dict[str, bool]:
        """Alive or not, for just these nodes (those a lookup returned: at most pages x cap): one MGET of
        their heartbeats, cached for min(1 s, heartbeat_s). Never reads the whole node set, which
        anyone who can write to Redis could fill with millions of ids."""
        nodes = list(nodes)
        now = time.monotonic()
        ttl = self._live_ttl
        with self._live_lock:
            need = [n for n in nodes if n not in self._live or now - self._live[n][1] >= ttl]
        if need:
            vals = self._reader.call(lambda c: c.mget([self._keys.node(n) for n in need]), chain=True)
            with self._live_lock:
                for n, v in zip(need, vals):
                    self._live[n] = (v is not None, now)
                if len(self._live) > 4096:  # bounded: forget what is stale
                    self._live = {n: e for n, e in self._live.items() if now - e[1] < ttl}
        with self._live_lock:
            return {n: self._live.get(n, (False, 0.0))[0] for n in nodes}
