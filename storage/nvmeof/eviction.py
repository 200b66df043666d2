"""Eviction order over a forest of keys: leaves first, least recently used first.

Shared by the radix tree (one order per tier, keyed by node id) and by the tier-3 page store
(keyed by page hash, parents taken from the hash chain), so flash evicts in the same
prefix-aware order as memory. A key is evictable when it is unpinned and, in leaves-first
mode, no child of it is present in the same order. Victim selection is O(log n): only
evictable keys sit in the two heaps (held, then the rest), so no eviction scans the whole set.

The heaps are `heapq` lists with lazy deletion: a key leaving one (evicted, pinned, touched, given
a child) only loses its entry's token, and stale entries are skipped when they reach the top, or
dropped all at once when they outnumber the live ones. Every step is one C call; the sorted
containers this replaced cost ~50 Python calls per eviction of two nodes, a third of its time.

A key may be marked *held elsewhere* (`hold`): tier 3 uses this for pages a faster tier
still holds. Such a key is evicted before any other, even with children present, because
its prefix stays reachable through the faster tier (which writes it back down when it lets
go, see TieredKVCache). Plain-LRU mode ignores the mark: it is the baseline.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

LEAVES_FIRST = "leaves_first"
PLAIN_LRU = "lru"
EVICTION_MODES = (LEAVES_FIRST, PLAIN_LRU)


class _Entry:
    __slots__ = ("key", "parent", "children", "stamp", "pins", "held", "where", "token")

    def __init__(self, key: Hashable, parent: Optional["_Entry"], stamp: int) -> None:
        self.key = key
        self.parent = parent  # the parent's entry object: a removed parent is detached, not looked up
        self.children = 0
        self.stamp = stamp
        self.pins = 0
        self.held = False
        self.where: Optional[list] = None  # the heap holding its live entry, if any
        self.token = 0  # its live entry's token: an entry with another token is stale


class EvictionOrder:
    """Leaves-first LRU (or plain per-key LRU, for comparison) with pinning."""

    def __init__(self, mode: str = LEAVES_FIRST) -> None:
        if mode not in EVICTION_MODES:
            raise ValueError(f"eviction mode: expected one of {EVICTION_MODES}, got {mode!r}")
        self.mode = mode
        self._entries: Dict[Hashable, _Entry] = {}
        # heaps of (stamp, token, key); an entry is live while its key's entry has that token and
        # `where` names that heap (stamps order; tokens are unique, so keys are never compared)
        self._evictable: List[Tuple[int, int, Hashable]] = []
        self._held: List[Tuple[int, int, Hashable]] = []  # held elsewhere: evicted first
        self._num_listed = 0  # live entries in both heaps
        self._detached: Dict[Hashable, _Entry] = {}  # removed keys whose children are still present
        self._clock = itertools.count(1)
        self._tokens = itertools.count(1)

    # -- queries -----------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def num_evictable(self) -> int:
        return self._num_listed

    def children_of(self, key: Hashable) -> int:
        return self._entries[key].children

    def parent_of(self, key: Hashable) -> Optional[Hashable]:
        p = self._live_parent(self._entries[key])
        return None if p is None else p.key

    def is_held(self, key: Hashable) -> bool:
        """Marked held by a faster tier (and so evicted ahead of the rest)."""
        e = self._entries.get(key)
        return e is not None and e.held and self.mode != PLAIN_LRU

    def is_evictable(self, key: Hashable) -> bool:
        e = self._entries.get(key)
        return e is not None and e.where is not None

    def victims(self, limit: int) -> List[Hashable]:
        """Up to `limit` keys in eviction order (an evicted leaf may expose its parent; call again)."""
        out: List[Hashable] = []
        for heap in (self._held, self._evictable):
            if len(out) < limit:
                out += self._smallest_live(heap, limit - len(out))
        return out

    def _smallest_live(self, heap: list, limit: int) -> List[Hashable]:
        """The `limit` smallest live keys of a heap, without walking all of it: a heap's smallest
        items are found from its root down (an item is smaller than its children), so this
        examines the items it returns, the stale ones among them, and their children."""
        out: List[Hashable] = []
        size = len(heap)
        frontier = [(heap[0], 0)] if size else []  # (item, its index); items are unique by token
        while frontier and len(out) < limit:
            item, i = heapq.heappop(frontier)
            if self._is_live(item, heap):
                out.append(item[2])
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))
        return out

    def peek_victim(self) -> Optional[Hashable]:
        entries = self._entries
        for heap in (self._held, self._evictable):
            while heap:
                _stamp, token, key = heap[0]
                e = entries.get(key)  # _is_live, inline: this runs on every eviction
                if e is not None and e.token == token and e.where is heap:
                    return key
                heapq.heappop(heap)
        return None

    # -- updates -----------------------------------------------------------------------
    def add(self, key: Hashable, parent: Optional[Hashable] = None, pinned: bool = False) -> None:
        """Insert a key (or touch it if present). A parent not in this order counts as absent.

        A key that was removed while children stayed (a held page evicted ahead of them) gets
        its children back when it returns, so leaves-first holds again across the round trip.
        """
        if key in self._entries:
            self.touch(key)
            return
        e = self._detached.pop(key, None)
        if e is None:
            e = _Entry(key, None, next(self._clock))
        else:
            e.stamp, e.held = next(self._clock), False
        e.pins = 1 if pinned else 0
        self._entries[key] = e
        p = None if parent is None else self._entries.get(parent)
        if p is not None:
            e.parent = p
            self._change_children(p, +1)
        elif parent is not None and parent in self._detached:  # its parent is away: wait for it
            e.parent = self._detached[parent]
            e.parent.children += 1
        self._refresh(e)

    def remove(self, key: Hashable) -> None:
        """Drop a key; children still present keep their link and rejoin it if it comes back."""
        e = self._entries.pop(key, None)
        if e is None:
            return
        if e.where is not None:
            e.where = None
            self._num_listed -= 1
        self._unlink(e)
        if e.children > 0:
            self._detached[key] = e

    def touch(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.stamp = next(self._clock)
        if e.where is not None:  # a new entry at its new place; the old one is stale
            self._push(e, e.where)

    def hold(self, key: Hashable, held: bool = True) -> None:
        """Mark (or unmark) a key as held by a faster tier: then it is the first to go."""
        e = self._entries.get(key)
        if e is None or e.held == held or self.mode == PLAIN_LRU:
            return
        e.held = held
        self._refresh(e)

    def insert_above(self, key: Hashable, head: Hashable, pinned: bool = False) -> None:
        """A new key between `key` and its parent (the tree split a node: `head` took its first
        pages). The same as add(head, parent) then set_parent(key, head), in one step: the
        parent's child count does not change, and `head`, with a child, is no victim yet."""
        if head in self._entries or head in self._detached:
            raise ValueError(f"insert_above: {head!r} is already in the order")
        e = self._entries[key]
        h = _Entry(head, e.parent, next(self._clock))
        h.pins = 1 if pinned else 0
        h.children = 1
        self._entries[head] = h
        e.parent = h
        self._refresh(h)  # a victim only in plain-LRU mode

    def set_parent(self, key: Hashable, parent: Optional[Hashable]) -> None:
        e = self._entries[key]
        new_parent = self._entries.get(parent) if parent is not None else None
        if e.parent is new_parent:
            return
        self._unlink(e)
        e.parent = new_parent
        if new_parent is not None:
            self._change_children(new_parent, +1)

    def pin(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.pins += 1
        self._refresh(e)

    def unpin(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        if e.pins <= 0:
            raise RuntimeError(f"unpin of key {key!r} that is not pinned")
        e.pins -= 1
        self._refresh(e)

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        """touch() each key in turn (a batch of reads, applied when a victim is next chosen).

        The same steps as touch() and _push(), inlined: this runs for every page a store reads,
        and the calls were half its cost."""
        entries, clock, tokens, push = self._entries, self._clock, self._tokens, heapq.heappush
        for key in keys:
            e = entries.get(key)
            if e is None:
                continue
            e.stamp = stamp = next(clock)
            heap = e.where
            if heap is not None:
                e.token = token = next(tokens)
                push(heap, (stamp, token, key))
                if len(heap) > 2 * self._num_listed + 64:
                    self._compact(heap)

    # -- internals ---------------------------------------------------------------------
    def _live_parent(self, e: _Entry) -> Optional[_Entry]:
        p = e.parent
        if p is not None and self._entries.get(p.key) is not p:
            if self._detached.get(p.key) is not p:  # gone for good (or replaced): forget it
                e.parent = None
            return None  # detached: not present now, but the link waits for its return
        return p

    def _unlink(self, e: _Entry) -> None:
        p = e.parent
        if p is None:
            return
        e.parent = None
        if self._entries.get(p.key) is p:
            self._change_children(p, -1)
        elif self._detached.get(p.key) is p:
            p.children -= 1
            if p.children <= 0:
                del self._detached[p.key]

    def _change_children(self, p: _Entry, delta: int) -> None:
        p.children += delta
        self._refresh(p)

    def _refresh(self, e: _Entry) -> None:
        """Put the entry where its state says (nowhere, held, or evictable); no change, no work:
        most refreshes (a parent losing one of several children) leave it where it was."""
        if e.pins:
            want = None
        elif e.held:
            want = self._held
        elif self.mode == PLAIN_LRU or e.children == 0:
            want = self._evictable
        else:
            want = None
        if want is e.where:
            return
        self._num_listed += (want is not None) - (e.where is not None)
        e.where = want
        if want is not None:
            self._push(e, want)

    def _push(self, e: _Entry, heap: list) -> None:
        e.token = token = next(self._tokens)
        heapq.heappush(heap, (e.stamp, token, e.key))
        if len(heap) > 2 * self._num_listed + 64:
            self._compact(heap)

    def _compact(self, heap: list) -> None:
        """Mostly stale: keep only the live entries (_is_live, inlined: a read path's touches pay
        for this, one item per touch on average, and the call was half of it)."""
        entries = self._entries
        heap[:] = [item for item in heap
                   if (e := entries.get(item[2])) is not None and e.token == item[1] and e.where is heap]
        heapq.heapify(heap)

    def _is_live(self, item: Tuple[int, int, Hashable], heap: list) -> bool:
        e = self._entries.get(item[2])
        return e is not None and e.token == item[1] and e.where is heap
