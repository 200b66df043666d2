"""Eviction order over a forest of keys: leaves first, least recently used first.

Shared by the radix tree (one order per tier, keyed by node id) and by the tier-3 page store
(keyed by page hash, parents taken from the hash chain), so flash evicts in the same
prefix-aware order as memory. A key is evictable when it is unpinned and, in leaves-first
mode, no child of it is present in the same order. Victim selection is O(log n): only
evictable keys sit in the sorted structures, so no eviction scans the whole set.

A key may be marked *held elsewhere* (`hold`): tier 3 uses this for pages a faster tier
still holds. Such a key is evicted before any other, even with children present, because
its prefix stays reachable through the faster tier (which writes it back down when it lets
go, see TieredKVCache). Plain-LRU mode ignores the mark: it is the baseline.
"""

from __future__ import annotations

import itertools
from typing import Dict, Hashable, Iterator, List, Optional, Sequence

from sortedcontainers import SortedDict

LEAVES_FIRST = "leaves_first"
PLAIN_LRU = "lru"
EVICTION_MODES = (LEAVES_FIRST, PLAIN_LRU)


class _Entry:
    __slots__ = ("key", "parent", "children", "stamp", "pins", "held")

    def __init__(self, key: Hashable, parent: Optional["_Entry"], stamp: int) -> None:
        self.key = key
        self.parent = parent  # the parent's entry object: a removed parent is detached, not looked up
        self.children = 0
        self.stamp = stamp
        self.pins = 0
        self.held = False


class EvictionOrder:
    """Leaves-first LRU (or plain per-key LRU, for comparison) with pinning."""

    def __init__(self, mode: str = LEAVES_FIRST) -> None:
        if mode not in EVICTION_MODES:
            raise ValueError(f"eviction mode: expected one of {EVICTION_MODES}, got {mode!r}")
        self.mode = mode
        self._entries: Dict[Hashable, _Entry] = {}
        self._evictable: SortedDict = SortedDict()  # stamp -> key
        self._held: SortedDict = SortedDict()  # stamp -> key: held elsewhere, evicted first
        self._detached: Dict[Hashable, _Entry] = {}  # removed keys whose children are still present
        self._clock = itertools.count(1)

    # -- queries -----------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def num_evictable(self) -> int:
        return len(self._evictable) + len(self._held)

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
        return e is not None and (e.stamp in self._evictable or e.stamp in self._held)

    def victims(self, limit: int) -> List[Hashable]:
        """Up to `limit` keys in eviction order (an evicted leaf may expose its parent; call again)."""
        return list(itertools.islice(itertools.chain(self._held.values(), self._evictable.values()), max(0, limit)))

    def peek_victim(self) -> Optional[Hashable]:
        if self._held:
            return self._held.peekitem(0)[1]
        if not self._evictable:
            return None
        return self._evictable.peekitem(0)[1]

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
        self._evictable.pop(e.stamp, None)
        self._held.pop(e.stamp, None)
        self._unlink(e)
        if e.children > 0:
            self._detached[key] = e

    def touch(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        was = self._evictable.pop(e.stamp, None) is not None
        was_held = self._held.pop(e.stamp, None) is not None
        e.stamp = next(self._clock)
        if was:
            self._evictable[e.stamp] = key
        if was_held:
            self._held[e.stamp] = key

    def hold(self, key: Hashable, held: bool = True) -> None:
        """Mark (or unmark) a key as held by a faster tier: then it is the first to go."""
        e = self._entries.get(key)
        if e is None or e.held == held or self.mode == PLAIN_LRU:
            return
        e.held = held
        self._refresh(e)

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
        """touch() each key in turn (a batch of reads, applied when a victim is next chosen)."""
        for key in keys:
            self.touch(key)

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
        self._evictable.pop(e.stamp, None)
        self._held.pop(e.stamp, None)
        if e.pins:
            return
        if e.held:
            self._held[e.stamp] = e.key
        elif self.mode == PLAIN_LRU or e.children == 0:
            self._evictable[e.stamp] = e.key
