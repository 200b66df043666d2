"""The fleet's view of tier 3 for one request: which nodes can serve how long a prefix, and how.

A KV-aware router asks, for a request's page keys (one chain), what each node could load instead
of recomputing. Through tier 3 a node serves a page two ways:
- DISK: it wrote the page into its own partition (its record is in the index);
- EXTERNAL: another node wrote it into a namespace this node also attaches (the shared pool),
  and this node reads it there by verified slot location.
So a node's tier-3 prefix is the longer of its DISK run and the run of pages *anyone* holds in a
namespace it attaches. `fleet_view` answers both from one index lookup (one MGET with a known
root; the index drops dead nodes' records), for the nodes that hold any page of the chain.
Which namespaces a node attaches is read from its own records (a node that holds no page of this
chain is not listed: the router knows it has nothing of the chain on DISK, and, if it attaches the
pool, can take `pool_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from radixtier.storage.api import STORAGE_TIER, PrefixIndex


@dataclass(frozen=True)
class NodeView:
    """What one node can serve of the chain from tier 3 (pages from the chain's start)."""

    disk: int       # pages it wrote itself (medium DISK)
    external: int   # pages it can read from a namespace it attaches, written by anyone (medium EXTERNAL)

    @property
    def best(self) -> int:
        return max(self.disk, self.external)


@dataclass(frozen=True)
class FleetView:
    """Per node, its tier-3 prefix of the chain; per namespace, the pool's run (any writer)."""

    nodes: Dict[str, NodeView]
    pool_runs: Dict[str, int]  # namespace uuid -> leading pages someone holds there

    def ranked(self) -> List[str]:
        """Nodes by the prefix they can serve from tier 3, longest first (ties: by name)."""
        return sorted(self.nodes, key=lambda n: (-self.nodes[n].best, n))


def fleet_view(index: PrefixIndex, root: Optional[bytes], keys: Sequence[bytes]) -> FleetView:
    """The tier-3 view of the chain `keys` (under `root`, None if unknown) across live nodes."""
    pages = index.lookup(root, keys, exclude_self=False)  # the leading run some live node holds
    disk: Dict[str, int] = {}
    attaches: Dict[str, set] = {}
    pool: Dict[str, int] = {}
    for i, recs in enumerate(pages):
        namespaces_here = set()
        for r in recs:
            if r.tier != STORAGE_TIER:
                continue
            attaches.setdefault(r.node_id, set()).add(r.location.namespace)
            namespaces_here.add(r.location.namespace)
            if disk.get(r.node_id, 0) == i:  # still unbroken from the start
                disk[r.node_id] = i + 1
            else:
                disk.setdefault(r.node_id, 0)
        for ns in namespaces_here:
            if pool.get(ns, 0) == i:
                pool[ns] = i + 1
            else:
                pool.setdefault(ns, 0)
    nodes = {node: NodeView(disk.get(node, 0), max((pool.get(ns, 0) for ns in spaces), default=0))
             for node, spaces in attaches.items()}
    return FleetView(nodes, pool)
