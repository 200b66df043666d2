"""The cross-node prefix index interface, and the in-process index (the embedded single-node default).

Keys are page hashes; a chain's pages are published under the chain's root page hash so a
whole chain can be looked up at once (and, in Redis Cluster, lives in one hash slot).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from radixtier.storage.page_store import PageLocation


@dataclass(frozen=True)
class PageRecord:
    """One node's claim that it holds a page, and where (for tier 3: a verifiable slot location)."""

    node_id: str
    tier: str
    location: PageLocation


@runtime_checkable
class PrefixIndex(Protocol):
    node_id: str

    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None: ...

    def unpublish(self, keys: Sequence[bytes]) -> None: ...

    def lookup(self, root: bytes, keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]: ...

    def close(self) -> None: ...


class InProcessRegistry:
    """The shared state behind in-process indexes; several nodes in one process may share one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: Dict[bytes, Dict[str, PageRecord]] = {}
        self.live_nodes: Dict[str, bool] = {}


class InProcessIndex:
    """Dict-backed PrefixIndex with the same semantics as the Redis index, minus the network."""

    def __init__(self, node_id: str = "local", registry: Optional[InProcessRegistry] = None) -> None:
        if not isinstance(node_id, str) or not node_id:
            raise ValueError(f"node_id: expected a non-empty string, got {node_id!r}")
        self.node_id = node_id
        self.registry = registry or InProcessRegistry()
        with self.registry.lock:
            self.registry.live_nodes[node_id] = True

    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        if len(keys) != len(records):
            raise ValueError(f"publish: {len(keys)} keys but {len(records)} records")
        with self.registry.lock:
            for key, rec in zip(keys, records):
                self.registry.pages.setdefault(bytes(key), {})[rec.node_id] = rec

    def unpublish(self, keys: Sequence[bytes]) -> None:
        with self.registry.lock:
            for key in keys:
                recs = self.registry.pages.get(bytes(key))
                if recs is not None:
                    recs.pop(self.node_id, None)
                    if not recs:
                        del self.registry.pages[bytes(key)]

    def lookup(self, root: bytes, keys: Sequence[bytes], exclude_self: bool = True) -> List[List[PageRecord]]:
        out: List[List[PageRecord]] = []
        with self.registry.lock:
            for key in keys:
                recs = [r for r in self.registry.pages.get(bytes(key), {}).values()
                        if self.registry.live_nodes.get(r.node_id) and not (exclude_self and r.node_id == self.node_id)]
                if not recs:
                    break
                out.append(recs)
        return out

    def mark_dead(self, node_id: str) -> None:
        with self.registry.lock:
            self.registry.live_nodes[node_id] = False

    def close(self) -> None:
        with self.registry.lock:
            self.registry.live_nodes[self.node_id] = False


def store_records(store, node_id: str) -> Iterator[Tuple[bytes, bytes, PageRecord]]:
    """(root, key, record) for every page a store holds, for (re-)publication after a restart.

    The root of a page is found by walking its parent links inside the store; leaves-first
    eviction keeps a page's ancestors present, and a page whose chain is broken is published
    under the highest ancestor found (then no lookup finds it: harmless).
    """
    entries = list(store.entries())
    parent_of = {key: parent for key, parent, _loc in entries}
    roots: Dict[bytes, bytes] = {}

    def root_of(key: bytes) -> bytes:
        path = []
        cur = key
        while cur not in roots:
            path.append(cur)
            p = parent_of.get(cur)
            if p is None or p not in parent_of or len(path) > len(parent_of):
                roots[cur] = cur  # chain start (or the highest ancestor still held)
                break
            cur = p
        r = roots[cur]
        for k in path:
            roots[k] = r
        return r

    for key, _parent, loc in entries:
        yield root_of(key), key, PageRecord(node_id, "storage", loc)
