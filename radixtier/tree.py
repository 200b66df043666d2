"""The three-tier radix tree: which token prefixes are cached, and in which tiers.

Page-granular and compressed: a node holds a run of whole pages, children are keyed by
their first page's tokens, and a partial match splits the node (as SGLang's radix_cache does).
Each node records its pages' tier presence, all-or-nothing per node for device and host
(slot lists into the page pools) and a leading-page count for storage (tier 3 evicts leaf
pages one at a time). Per-tier eviction orders are leaves-first LRU (`EvictionOrder`).

Page keys (the chained hashes tier 3 and the prefix index name pages by) are computed lazily,
by `page_keys(node)`, the first time a transfer, tier 3 or the index needs them: a match hashes
nothing, and an insert that stays in device and host memory never hashes at all. A node's keys,
once computed, are in `_by_key` (how a finished transfer finds the nodes its pages now belong to),
each with its page's depth in the tree: a split moves no key of the tail, so a lookup stays O(1)
however large a node is.

Not thread-safe by itself: `TieredKVCache` serialises access under its lock. Two hooks let
the owner keep state the tree does not: `busy(node)` (a node with work in flight elsewhere is
neither pruned nor reused by `materialize`) and `on_split(node, head)` (a node was split and
`head` took its first pages).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from radixtier.eviction import LEAVES_FIRST, EvictionOrder
from radixtier.hashing import PageHasher, as_token_array
from radixtier.tiers import Tier

MEMORY_TIERS = (Tier.DEVICE, Tier.HOST)
_INT64 = np.dtype("<i8")


def _token_array(tokens) -> np.ndarray:
    """Tokens as int64: an array the cache already normalised passes through unchecked (checking
    a 32K-token request again costs as much as matching it)."""
    if type(tokens) is np.ndarray and tokens.dtype == _INT64 and tokens.ndim == 1:
        return tokens
    return as_token_array(tokens)


class Node:
    """Tree state only: tokens, keys, tier presence, lock count and hits. Transfers in flight are
    the cache's (its InFlight table), not the node's: the tree can be read and tested alone."""

    __slots__ = ("id", "parent", "children", "child_key", "tokens", "num_pages", "start_page", "keys", "device",
                 "host", "storage_pages", "lock_ref", "hits")

    def __init__(self, node_id: int, parent: Optional["Node"], tokens: np.ndarray, num_pages: int,
                 child_key: tuple, keys: Optional[List[bytes]] = None, start_page: int = 0) -> None:
        self.id = node_id
        self.parent = parent
        self.children: Dict[tuple, Node] = {}
        self.child_key = child_key  # its key in parent.children: its first page's tokens
        self.tokens = tokens
        self.num_pages = num_pages
        self.start_page = start_page  # pages above this node on its path from the root
        self.keys = keys  # page keys once RadixTree.page_keys computed them (None until then)
        self.device: Optional[np.ndarray] = None  # device pool slots (int64), one per page
        self.host: Optional[np.ndarray] = None  # host pool slots (int64), one per page
        self.storage_pages = 0  # leading pages present in tier 3
        self.lock_ref = 0
        self.hits = 0

    @property
    def in_storage(self) -> bool:
        return self.num_pages > 0 and self.storage_pages >= self.num_pages

    def slots(self, tier: Tier) -> Optional[np.ndarray]:
        return self.device if tier == Tier.DEVICE else self.host

    def best_tier(self) -> Optional[Tier]:
        if self.device is not None:
            return Tier.DEVICE
        if self.host is not None:
            return Tier.HOST
        if self.in_storage:
            return Tier.STORAGE
        return None

    def has_presence(self) -> bool:
        return self.device is not None or self.host is not None or self.storage_pages > 0

    def __repr__(self) -> str:
        return (f"Node(id={self.id}, pages={self.num_pages}, device={self.device is not None}, "
                f"host={self.host is not None}, storage={self.storage_pages}, lock={self.lock_ref})")


@dataclass
class TreeMatch:
    """Structural match: nodes whose tokens equal the request's leading pages (any presence)."""

    nodes: List[Node]
    num_pages: int
    last: Node


@dataclass
class UsablePrefix:
    """The leading run of matched nodes that some tier holds, with the tier that serves each."""

    nodes: List[Node] = field(default_factory=list)
    tiers: List[Tier] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(n.num_pages for n in self.nodes)

    def pages_in(self, tier: Tier) -> int:
        return self.pages_by_tier()[tier]

    def pages_by_tier(self) -> Dict[Tier, int]:
        """Pages per serving tier, in one pass (the serving path's match asks for all three)."""
        out = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.STORAGE: 0}
        for n, t in zip(self.nodes, self.tiers):
            out[t] += n.num_pages
        return out


class RadixTree:
    """Prefix tree of KV pages with per-tier presence and leaves-first eviction orders."""

    def __init__(self, hasher: PageHasher, eviction_mode: str = LEAVES_FIRST,
                 busy: Optional[Callable[[Node], bool]] = None,
                 on_split: Optional[Callable[[Node, Node], None]] = None) -> None:
        self.hasher = hasher
        self._busy = busy or (lambda _node: False)
        self._on_split = on_split
        self.page_size = hasher.page_size
        self._ids = itertools.count(1)
        self.root = Node(0, None, np.zeros(0, dtype="<i8"), 0, (), [])
        self.root.lock_ref = 1  # never evicted, never split
        self._nodes: Dict[int, Node] = {0: self.root}
        # hashed page -> its node, and -> its depth in the tree (two dicts, no tuple per page: a
        # tuple holding a node is one more object for every full garbage collection to walk)
        self._by_key: Dict[bytes, Node] = {}
        self._depth: Dict[bytes, int] = {}
        self.orders: Dict[Tier, EvictionOrder] = {t: EvictionOrder(eviction_mode) for t in MEMORY_TIERS}
        self._pages_in: Dict[Tier, int] = {Tier.DEVICE: 0, Tier.HOST: 0, Tier.STORAGE: 0}

    # -- structure ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes) - 1

    def nodes(self) -> Iterator[Node]:
        return (n for n in self._nodes.values() if n is not self.root)

    def pages_in(self, tier: Tier) -> int:
        return self._pages_in[tier]

    def node_of_key(self, key: bytes) -> Optional[Tuple[Node, int]]:
        """The node holding a page whose key was computed, and the page's index in it."""
        node = self._by_key.get(key)
        if node is None:
            return None
        return node, self._depth[key] - node.start_page

    def page_keys(self, node: Node) -> List[bytes]:
        """The node's page keys, hashing it (and any ancestor not hashed yet) on first use."""
        if node.keys is not None:
            return node.keys
        pending = []
        top = node
        while top.keys is None:
            pending.append(top)
            top = top.parent
        parent_key = top.keys[-1] if top.keys else None
        for n in reversed(pending):
            n.keys = self.hasher.chain(n.tokens, parent=parent_key)
            for i, key in enumerate(n.keys, n.start_page):
                self._by_key[key] = n
                self._depth[key] = i
            parent_key = n.keys[-1]
        return node.keys

    def _child_key(self, tokens: np.ndarray, offset: int) -> tuple:
        return tuple(tokens[offset:offset + self.page_size].tolist())

    def match(self, tokens, split: bool = True) -> TreeMatch:
        """Longest structural match over full pages; splits a partially matched node when `split`."""
        arr = _token_array(tokens)
        ps = self.page_size
        total_pages = arr.size // ps
        node, pages, path = self.root, 0, []
        while pages < total_pages:
            child = node.children.get(self._child_key(arr, pages * ps))
            if child is None:
                break
            n = min(child.num_pages, total_pages - pages)
            seg = arr[pages * ps:(pages + n) * ps]
            same = child.tokens[:n * ps] == seg  # one pass; np.array_equal's checks cost 3x this
            k = n if same.all() else int(same.argmin()) // ps  # argmin: the first token that differs
            if k < child.num_pages:
                if not split:
                    if k:
                        path.append(child)
                        pages += k
                    break
                child = self.split(child, k)
            path.append(child)
            pages += k
            node = child
            if k < n:
                break
        last = path[-1] if path else self.root
        return TreeMatch(path, pages, last)

    def split(self, node: Node, k: int) -> Node:
        """Split `node` after its first k pages; returns the new head (the parent of `node`)."""
        if not 0 < k < node.num_pages:
            raise ValueError(f"split: k={k} outside 1..{node.num_pages - 1}")
        ps = self.page_size
        parent = node.parent
        keys = node.keys
        head = Node(next(self._ids), parent, node.tokens[:k * ps], k, node.child_key,
                    None if keys is None else keys[:k], node.start_page)
        node.tokens, node.num_pages, node.start_page = node.tokens[k * ps:], node.num_pages - k, node.start_page + k
        node.child_key = self._child_key(node.tokens, 0)
        node.keys = None if keys is None else keys[k:]
        if node.device is not None:
            head.device, node.device = node.device[:k], node.device[k:]
        if node.host is not None:
            head.host, node.host = node.host[:k], node.host[k:]
        head.storage_pages = min(node.storage_pages, k)
        node.storage_pages = max(0, node.storage_pages - k)
        head.lock_ref = node.lock_ref
        head.hits = node.hits
        parent.children[head.child_key] = head
        head.children[node.child_key] = node
        node.parent = head
        self._nodes[head.id] = head
        for key in head.keys or ():  # their depths do not change
            self._by_key[key] = head
        for tier, slots in ((Tier.DEVICE, head.device), (Tier.HOST, head.host)):
            if slots is not None:
                self.orders[tier].insert_above(node.id, head.id, pinned=head.lock_ref > 0)
        if self._on_split is not None:
            self._on_split(node, head)
        return head

    def drop_tail(self, node: Node, tier: Tier, n: int) -> np.ndarray:
        """Take a leaf's last n pages out of the tree; returns their slots in `tier` to free.

        Eviction's cheap split, for pages whose only copy is in `tier`: a leaf never hashed (so
        in no index, never in tier 3) and in no other memory tier loses its tail in place. No node
        is made, and the node keeps its place in the LRU order: it is still the oldest."""
        other = node.host if tier == Tier.DEVICE else node.device
        own = node.slots(tier)
        if (node.children or node.keys is not None or node.storage_pages or other is not None or own is None
                or not 0 < n < node.num_pages):
            raise ValueError(f"drop_tail: node {node.id} ({node.num_pages} pages) cannot lose {n} pages in place")
        keep = node.num_pages - n
        self._assign(node, tier, own[:keep])
        node.tokens = node.tokens[:keep * self.page_size]
        node.num_pages = keep
        self._pages_in[tier] -= n
        return own[keep:]

    def _assign(self, node: Node, tier: Tier, slots: Optional[np.ndarray]) -> None:
        if tier == Tier.DEVICE:
            node.device = slots
        else:
            node.host = slots

    def extend(self, match: TreeMatch, tokens, num_pages: int) -> Optional[Node]:
        """Add a leaf for pages [match.num_pages, num_pages) under match.last (no presence yet, not hashed)."""
        arr = _token_array(tokens)
        start = match.num_pages
        if num_pages <= start:
            return None
        if num_pages * self.page_size > arr.size:
            raise ValueError(f"extend: {num_pages} pages need {num_pages * self.page_size} tokens, got {arr.size}")
        parent = match.last
        tokens = arr[start * self.page_size:num_pages * self.page_size].copy()  # the caller's buffer may change
        node = Node(next(self._ids), parent, tokens, num_pages - start, self._child_key(tokens, 0), start_page=start)
        parent.children[node.child_key] = node
        self._nodes[node.id] = node
        return node

    def insert(self, tokens, num_pages: Optional[int] = None) -> Tuple[TreeMatch, Optional[Node]]:
        arr = _token_array(tokens)
        total = arr.size // self.page_size if num_pages is None else num_pages
        m = self.match(arr[:total * self.page_size])
        return m, self.extend(m, arr, total)

    def materialize(self, tokens, start_page: int, end_page: int) -> List[Node]:
        """Nodes covering exactly pages [start_page, end_page): reuses empty structural nodes, extends the rest.

        Stops early (returns fewer pages) at a node that already holds data or has a transfer in flight.
        """
        arr = _token_array(tokens)
        ps = self.page_size
        head = self.match(arr[:start_page * ps])
        if head.num_pages != start_page:
            return []
        full = self.match(arr[:end_page * ps])
        out: List[Node] = []
        for node in full.nodes[len(head.nodes):]:
            if node.has_presence() or self._busy(node):
                return out
            out.append(node)
        new = self.extend(full, arr, end_page)
        if new is not None:
            out.append(new)
        return out

    def chunk(self, node: Node, max_pages: int) -> List[Node]:
        """Split a node into runs of at most max_pages, so transfers complete (and count) piecewise."""
        out: List[Node] = []
        while node.num_pages > max_pages:
            out.append(self.split(node, max_pages))
        out.append(node)
        return out

    def keys_after(self, match: TreeMatch, tokens, limit: Optional[int] = None) -> List[bytes]:
        """Page keys of the request's pages beyond the structural match (computed, not stored)."""
        arr = _token_array(tokens)
        last = self.page_keys(match.last)
        parent = last[-1] if last else None
        return self.hasher.chain(arr, parent=parent, start_page=match.num_pages, num_pages=limit)

    def path_to_root(self, node: Node) -> List[Node]:
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    # -- presence ----------------------------------------------------------------------
    def usable_prefix(self, match: TreeMatch, split: bool = True) -> UsablePrefix:
        """Leading matched nodes held by some tier; a partial storage run is split off and ends it."""
        out = UsablePrefix()
        for idx, node in enumerate(match.nodes):
            tier = node.best_tier()
            if tier is None:
                if split and 0 < node.storage_pages < node.num_pages:
                    head = self.split(node, node.storage_pages)
                    match.nodes.insert(idx, head)
                    out.nodes.append(head)
                    out.tiers.append(Tier.STORAGE)
                break
            out.nodes.append(node)
            out.tiers.append(tier)
        return out

    def set_slots(self, node: Node, tier: Tier, slots: Sequence[int]) -> None:
        if len(slots) != node.num_pages:
            raise ValueError(f"set_slots: node has {node.num_pages} pages, got {len(slots)} slots")
        if node.slots(tier) is not None:
            raise RuntimeError(f"set_slots: node {node.id} already present in {tier.label}")
        self._assign(node, tier, np.asarray(slots, dtype=np.int64))
        self._pages_in[tier] += node.num_pages
        self.orders[tier].add(node.id, self._order_parent(node), pinned=node.lock_ref > 0)
        for child in node.children.values():
            if child.slots(tier) is not None:
                self.orders[tier].set_parent(child.id, node.id)

    def clear_slots(self, node: Node, tier: Tier) -> np.ndarray:
        """Drop a node from a memory tier; returns the slots for the caller to free."""
        if tier == Tier.DEVICE:
            slots, node.device = node.device, None
        else:
            slots, node.host = node.host, None
        if slots is None:
            return np.zeros(0, dtype=np.int64)
        self._pages_in[tier] -= node.num_pages
        self.orders[tier].remove(node.id)
        return slots

    def set_storage_pages(self, node: Node, count: int) -> None:
        count = max(0, min(count, node.num_pages))
        self._pages_in[Tier.STORAGE] += count - node.storage_pages
        node.storage_pages = count

    def storage_evicted(self, key: bytes) -> None:
        """Tier 3 dropped a page: the node's storage run now ends before it."""
        hit = self.node_of_key(key)
        if hit is None:
            return
        node, idx = hit
        if idx < node.storage_pages:
            self.set_storage_pages(node, idx)

    def _order_parent(self, node: Node) -> Optional[int]:
        p = node.parent
        return None if p is None or p is self.root else p.id

    # -- locking -----------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Lock node and its ancestors: none of them can be evicted or moved out of a tier."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                for order in self.orders.values():
                    order.pin(node.id)
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock: node {node.id} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                for order in self.orders.values():
                    order.unpin(node.id)
            node = node.parent

    def touch(self, nodes: List[Node]) -> None:
        for node in nodes:
            node.hits += 1
            for tier in MEMORY_TIERS:
                if node.slots(tier) is not None:
                    self.orders[tier].touch(node.id)

    # -- eviction ----------------------------------------------------------------------
    def victims(self, tier: Tier, limit: int) -> List[Node]:
        return [self._nodes[i] for i in self.orders[tier].victims(limit)]

    def peek_victim(self, tier: Tier) -> Optional[Node]:
        key = self.orders[tier].peek_victim()
        return None if key is None else self._nodes[key]

    def prune(self, node: Node) -> int:
        """Remove node and then its ancestors while each is an empty, unlocked leaf."""
        removed = 0
        while (node is not self.root and not node.children and node.lock_ref == 0
               and not node.has_presence() and not self._busy(node)):
            parent = node.parent
            if parent is None or parent.children.get(node.child_key) is not node:
                break  # already detached
            del parent.children[node.child_key]
            del self._nodes[node.id]
            for key in node.keys or ():
                if self._by_key.get(key) is node:
                    del self._by_key[key]
                    del self._depth[key]
            removed += 1
            node = parent
        return removed
