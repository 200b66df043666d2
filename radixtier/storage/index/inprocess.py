"""The in-process prefix index: the embedded single-node default (same semantics as Redis, no server)."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence

from radixtier import validate
from radixtier.storage.api import STORAGE_TIER, LocationTuple, PageRecord, Republisher


class InProcessRegistry:
    """The shared state behind in-process indexes; several nodes in one process may share one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pages: Dict[bytes, Dict[str, PageRecord]] = {}
        self.live_nodes: Dict[str, bool] = {}


class InProcessIndex:
    """Dict-backed PrefixIndex with the same semantics as the Redis index, minus the network."""

    def __init__(self, node_id: str = "local", registry: Optional[InProcessRegistry] = None) -> None:
        self.node_id = validate.node_id("node_id", node_id)
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

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes],
               exclude_self: bool = True) -> List[List[PageRecord]]:
        """Records are keyed by page alone here, so the root (known or not) is not needed."""
        out: List[List[PageRecord]] = []
        with self.registry.lock:
            for key in keys:
                recs = [r for r in self.registry.pages.get(bytes(key), {}).values()
                        if self.registry.live_nodes.get(r.node_id) and not (exclude_self and r.node_id == self.node_id)]
                if not recs:
                    break
                out.append(recs)
        return out

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes],
                         namespace: str) -> List[LocationTuple]:
        out: List[LocationTuple] = []
        for recs in self.lookup(root, keys):
            loc = next((r.location for r in recs if r.tier == STORAGE_TIER and r.location.namespace == namespace), None)
            if loc is None:
                break
            out.append((loc.namespace, loc.slot, loc.generation, loc.length, loc.checksum))
        return out

    def set_republisher(self, fn: Republisher) -> None:
        """Nothing to do: records live as long as this process, which is as long as the store is open."""

    def flush(self, timeout: float = 10.0) -> bool:
        return True  # publishes take effect at once

    def health(self) -> Dict[str, object]:
        with self.registry.lock:
            pages = len(self.registry.pages)
        return {"up": True, "writer_up": True, "queue_depth": 0, "pages": pages}

    def mark_dead(self, node_id: str) -> None:
        with self.registry.lock:
            self.registry.live_nodes[node_id] = False

    def close(self) -> None:
        with self.registry.lock:
            self.registry.live_nodes[self.node_id] = False
