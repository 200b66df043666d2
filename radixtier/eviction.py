"""Eviction order over a forest of keys: leaves first, least recently used first.

Shared by the radix tree (one order per tier, keyed by node id) and by the tier-3 page store
(keyed by page hash, parents taken from the hash chain), so flash evicts in the same
prefix-aware order as memory. A key is evictable when it is unpinned and, in leaves-first
mode, no child of it is present in the same order. Victim selection is O(log n): only
evictable keys sit in the two heaps (held, then the rest), so no eviction scans the whole set.

A key's state lives in flat arrays indexed by a small integer id (its parent's id, child count,
stamp, pins, held mark, heap, token), not in an object per key. A store of a million pages kept a
million long-lived objects here, and every full collection of the garbage collector walked them
all: 125 ms per collection, against 11 ms without them, a pause for every thread of an SGLang
process. Arrays, a dict of key -> id and heaps of int tuples are not walked object by object.

The heaps are `heapq` lists of (stamp, token, id) with lazy deletion: a key leaving one (evicted,
pinned, touched, given a child) only loses its token (a new one, or 0 off the heaps), and stale
items are skipped when they reach the top, or dropped all at once when they outnumber the live
ones. Tokens are never reused, so an item is live exactly when its id still holds its token.

A key may be marked *held elsewhere* (`hold`): tier 3 uses this for pages a faster tier
still holds. Such a key is evicted before any other, even with children present, because
its prefix stays reachable through the faster tier (which writes it back down when it lets
go, see TieredKVCache). Plain-LRU mode ignores the mark: it is the baseline.

"Do not evict" is one mechanism, the pin, in two forms with one meaning (never a victim while
pinned; `is_pinned` asks both): `pin`/`unpin` count per key (the tree's lock references: a few
keys, held for a request's life), and `pin_batch`/`unpin_batch` pin a whole batch as one set (a
store's read in flight: thousands of keys for microseconds, where counting per key was two Python
loops on the read path). A batch-pinned key stays on its heap; `next_victim` passes over it (and
touches it: it is being read, so it is recent). `hold` is not a pin: it marks a key to go *first*.

A removed key whose children are still present is *detached*: it keeps its id (and its child
count) so the children rejoin it if it returns; its id is freed when its last child leaves. So a
parent id always names a present or detached key, never a freed or reused id.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

LEAVES_FIRST = "leaves_first"
PLAIN_LRU = "lru"
EVICTION_MODES = (LEAVES_FIRST, PLAIN_LRU)

_NOWHERE, _EVICTABLE, _HELD = 0, 1, 2  # which heap holds a key's live item
_NO_PARENT = -1

HeapItem = Tuple[int, int, int]  # (stamp, token, id): stamps order, tokens are unique


def smallest_live(heap: List[HeapItem], limit: int, is_live: Callable[[HeapItem], bool]) -> List[HeapItem]:
    """The `limit` smallest live items of a heap, without walking all of it: a heap's smallest
    items are found from its root down (an item is smaller than its children), so this examines
    the items it returns, the stale ones among them, and their children."""
    out: List[HeapItem] = []
    size = len(heap)
    frontier = [(heap[0], 0)] if size else []  # (item, its index); items are unique by token
    while frontier and len(out) < limit:
        item, i = heapq.heappop(frontier)
        if is_live(item):
            out.append(item)
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
    return out


class EvictionOrder:
    """Leaves-first LRU (or plain per-key LRU, for comparison) with pinning.

    Not thread-safe: its owner (the tree's lock, the store's lock) serialises every call."""

    def __init__(self, mode: str = LEAVES_FIRST) -> None:
        if mode not in EVICTION_MODES:
            raise ValueError(f"eviction mode: expected one of {EVICTION_MODES}, got {mode!r}")
        self.mode = mode
        self._plain = mode == PLAIN_LRU
        self._ids: Dict[Hashable, int] = {}  # present keys
        self._detached: Dict[Hashable, int] = {}  # removed keys whose children are still present
        # per id; an id is present (in _ids), detached, or free (on _free_ids, key None)
        self._keys: List[Optional[Hashable]] = []
        self._parent = array("q")  # the parent's id, or _NO_PARENT
        self._children = array("q")  # present keys linked to this one
        self._stamp = array("q")  # last add or touch: older goes first
        self._pins = array("q")
        self._held = bytearray()  # 1: held by a faster tier (never set in plain-LRU mode)
        self._where = bytearray()  # _NOWHERE, _EVICTABLE or _HELD
        self._token = array("q")  # the token of its live heap item; 0 while on no heap
        self._free_ids = array("q")
        self._heaps: Tuple[List[HeapItem], ...] = ([], [], [])  # by _where; [_NOWHERE] stays empty
        self._num_listed = 0  # live items in both heaps
        self._clock = itertools.count(1)
        self._tokens = itertools.count(1)
        self._batches: Dict[int, frozenset] = {}  # pin_batch token -> its keys
        self._next_batch = 0

    # -- queries -----------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._ids)

    def num_evictable(self) -> int:
        return self._num_listed

    def children_of(self, key: Hashable) -> int:
        return self._children[self._ids[key]]

    def parent_of(self, key: Hashable) -> Optional[Hashable]:
        """The key's parent while that parent is present (None while it is away or absent)."""
        p = self._parent[self._ids[key]]
        if p == _NO_PARENT or self._ids.get(self._keys[p]) != p:
            return None
        return self._keys[p]

    def is_held(self, key: Hashable) -> bool:
        """Marked held by a faster tier (and so evicted ahead of the rest)."""
        i = self._ids.get(key)
        return i is not None and self._held[i] == 1

    def is_evictable(self, key: Hashable) -> bool:
        i = self._ids.get(key)
        return i is not None and self._where[i] != _NOWHERE

    def victims(self, limit: int) -> List[Hashable]:
        """Up to `limit` keys in eviction order (an evicted leaf may expose its parent; call again)."""
        token, keys = self._token, self._keys
        out: List[Hashable] = []
        for heap in (self._heaps[_HELD], self._heaps[_EVICTABLE]):
            if len(out) < limit:
                live = smallest_live(heap, limit - len(out), lambda item: token[item[2]] == item[1])
                out += [keys[i] for _stamp, _token, i in live]
        return out

    def peek_victim(self) -> Optional[Hashable]:
        token = self._token
        for heap in (self._heaps[_HELD], self._heaps[_EVICTABLE]):
            while heap:
                _stamp, t, i = heap[0]
                if token[i] == t:
                    return self._keys[i]
                heapq.heappop(heap)
        return None

    def next_victim(self) -> Optional[Hashable]:
        """peek_victim, passing over batch-pinned keys (each touched, so the next in line comes up);
        None when every candidate is pinned."""
        victim = self.peek_victim()
        for _ in range(sum(map(len, self._batches.values()))):
            if victim is None or not self._in_batch(victim):
                break
            self.touch(victim)
            victim = self.peek_victim()
        return None if victim is None or self._in_batch(victim) else victim

    # -- do not evict (see the module docstring) --------------------------------------------
    def is_pinned(self, key: Hashable) -> bool:
        i = self._ids.get(key)
        return (i is not None and self._pins[i] > 0) or self._in_batch(key)

    def pin_batch(self, keys) -> int:
        """Pin every key of a batch at once (present or not); returns the token unpin_batch takes."""
        token = self._next_batch
        self._next_batch += 1
        self._batches[token] = frozenset(keys)
        return token

    def unpin_batch(self, token: int) -> None:
        del self._batches[token]

    def batch_pins(self) -> int:
        """Keys batch-pinned now, counting a key once per batch that holds it (a bound, not a census)."""
        return sum(map(len, self._batches.values()))

    def _in_batch(self, key: Hashable) -> bool:
        for keys in self._batches.values():  # as many as concurrent reads: a handful
            if key in keys:
                return True
        return False

    # -- updates -----------------------------------------------------------------------
    def add(self, key: Hashable, parent: Optional[Hashable] = None, pinned: bool = False) -> None:
        """Insert a key (or touch it if present). A parent not in this order counts as absent.

        A key that was removed while children stayed (a held page evicted ahead of them) gets
        its children back when it returns, so leaves-first holds again across the round trip.
        """
        if key in self._ids:
            self.touch(key)
            return
        i = self._detached.pop(key, None)
        if i is None:
            i = self._new_id(key)
        else:
            self._held[i] = 0
        self._stamp[i] = next(self._clock)
        self._pins[i] = 1 if pinned else 0
        self._ids[key] = i
        if parent is not None:
            p = self._ids.get(parent)
            if p is not None:
                self._parent[i] = p
                self._change_children(p, +1)
            else:
                p = self._detached.get(parent)
                if p is not None:  # its parent is away: wait for it
                    self._parent[i] = p
                    self._children[p] += 1
        self._refresh(i)

    def remove(self, key: Hashable) -> None:
        """Drop a key; children still present keep their link and rejoin it if it comes back."""
        i = self._ids.pop(key, None)
        if i is None:
            return
        if self._where[i] != _NOWHERE:
            self._where[i], self._token[i] = _NOWHERE, 0
            self._num_listed -= 1
        self._unlink(i)
        if self._children[i] > 0:
            self._detached[key] = i
        else:
            self._free_id(i)

    def touch(self, key: Hashable) -> None:
        i = self._ids.get(key)
        if i is None:
            return
        self._stamp[i] = next(self._clock)
        if self._where[i] != _NOWHERE:  # a new item at its new place; the old one is stale
            self._push(i)

    def hold(self, key: Hashable, held: bool = True) -> None:
        """Mark (or unmark) a key as held by a faster tier: then it is the first to go."""
        i = self._ids.get(key)
        if i is None or self._plain or self._held[i] == held:
            return
        self._held[i] = 1 if held else 0
        self._refresh(i)

    def insert_above(self, key: Hashable, head: Hashable, pinned: bool = False) -> None:
        """A new key between `key` and its parent (the tree split a node: `head` took its first
        pages). The same as add(head, parent) then set_parent(key, head), in one step: the
        parent's child count does not change, and `head`, with a child, is no victim yet."""
        if head in self._ids or head in self._detached:
            raise ValueError(f"insert_above: {head!r} is already in the order")
        i = self._ids[key]
        h = self._new_id(head)
        self._parent[h] = self._parent[i]
        self._stamp[h] = next(self._clock)
        self._pins[h] = 1 if pinned else 0
        self._children[h] = 1
        self._ids[head] = h
        self._parent[i] = h
        self._refresh(h)  # a victim only in plain-LRU mode

    def set_parent(self, key: Hashable, parent: Optional[Hashable]) -> None:
        i = self._ids[key]
        p = _NO_PARENT if parent is None else self._ids.get(parent, _NO_PARENT)
        if self._parent[i] == p:
            return
        self._unlink(i)
        if p != _NO_PARENT:
            self._parent[i] = p
            self._change_children(p, +1)

    def pin(self, key: Hashable) -> None:
        i = self._ids.get(key)
        if i is None:
            return
        self._pins[i] += 1
        self._refresh(i)

    def unpin(self, key: Hashable) -> None:
        i = self._ids.get(key)
        if i is None:
            return
        if self._pins[i] <= 0:
            raise RuntimeError(f"unpin of key {key!r} that is not pinned")
        self._pins[i] -= 1
        self._refresh(i)

    def touch_many(self, keys: Sequence[Hashable]) -> None:
        """touch() each key in turn (a batch of reads, applied when a victim is next chosen).

        The same steps as touch() and _push(), inlined: this runs for every page a store reads,
        and the calls were half its cost."""
        ids, stamp, where, token, heaps = self._ids, self._stamp, self._where, self._token, self._heaps
        clock, tokens, push = self._clock, self._tokens, heapq.heappush
        for key in keys:
            i = ids.get(key)
            if i is None:
                continue
            stamp[i] = s = next(clock)
            w = where[i]
            if w != _NOWHERE:
                token[i] = t = next(tokens)
                heap = heaps[w]
                push(heap, (s, t, i))
                if len(heap) > 2 * self._num_listed + 64:
                    self._compact(heap)

    # -- internals ---------------------------------------------------------------------
    def _new_id(self, key: Hashable) -> int:
        """A free id for `key`, its fields reset (no parent, no children, on no heap)."""
        if not self._free_ids:
            self._grow()
        i = self._free_ids.pop()
        self._keys[i] = key
        self._parent[i] = _NO_PARENT
        self._children[i] = 0
        self._pins[i] = 0
        self._held[i] = 0
        self._where[i] = _NOWHERE
        self._token[i] = 0
        return i

    def _grow(self) -> None:
        """Double the arrays (at least 64 ids): growth is amortised, not one append per field per key."""
        n = len(self._keys)
        more = max(64, n)
        self._keys.extend([None] * more)
        for arr in (self._parent, self._children, self._stamp, self._pins, self._token):
            arr.extend(array("q", bytes(8 * more)))
        self._held.extend(bytes(more))
        self._where.extend(bytes(more))
        self._free_ids.extend(range(n + more - 1, n - 1, -1))  # the lowest id is handed out first

    def _free_id(self, i: int) -> None:
        self._keys[i] = None
        self._free_ids.append(i)

    def _unlink(self, i: int) -> None:
        """Cut the key's link to its parent; a detached parent left with no child is freed."""
        p = self._parent[i]
        if p == _NO_PARENT:
            return
        self._parent[i] = _NO_PARENT
        pkey = self._keys[p]
        if self._ids.get(pkey) == p:
            self._change_children(p, -1)
        else:  # detached: only its count changes until it returns
            self._children[p] -= 1
            if self._children[p] <= 0:
                del self._detached[pkey]
                self._free_id(p)

    def _change_children(self, p: int, delta: int) -> None:
        self._children[p] += delta
        self._refresh(p)

    def _refresh(self, i: int) -> None:
        """Put the key where its state says (nowhere, held, or evictable); no change, no work:
        most refreshes (a parent losing one of several children) leave it where it was."""
        if self._pins[i]:
            want = _NOWHERE
        elif self._held[i]:
            want = _HELD
        elif self._plain or self._children[i] == 0:
            want = _EVICTABLE
        else:
            want = _NOWHERE
        have = self._where[i]
        if want == have:
            return
        self._num_listed += (want != _NOWHERE) - (have != _NOWHERE)
        self._where[i] = want
        if want == _NOWHERE:
            self._token[i] = 0  # its item, wherever it is, is stale now
        else:
            self._push(i)

    def _push(self, i: int) -> None:
        self._token[i] = t = next(self._tokens)
        heap = self._heaps[self._where[i]]
        heapq.heappush(heap, (self._stamp[i], t, i))
        if len(heap) > 2 * self._num_listed + 64:
            self._compact(heap)

    def _compact(self, heap: List[HeapItem]) -> None:
        """Mostly stale: keep only the live items (a read path's touches pay for this, one item per
        touch on average)."""
        token = self._token
        heap[:] = [item for item in heap if token[item[2]] == item[1]]
        heapq.heapify(heap)
