"""A node's client of tier 3: its own partition first, then other nodes' pages through the prefix
index, and what follows a write -- the part of the storage layer both serving paths share.

`TierClient` owns the `Publisher` (what the index is told) and the hint cache: remote page
locations a lookup (SGLang's batch_exists) found, kept for the read that follows so the read
asks the index only for what it was not told. It reads and writes through the store's batch
calls only; a page another node wrote is read at its location in one verified batch, and a stale
location is a miss, never wrong bytes.

Failure: like the store, a bad argument raises ValueError before any I/O; the index is advisory
(an index that cannot answer means "nothing remote"); an I/O failure is a per-page miss.

Locks: `_hints_lock` guards the hint cache only; it is never held across a store or index call.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from radixtier.storage.api import (BufferLike, LocationTuple, PageStore, PrefixIndex, PutResult, RouterTag,
                                   TaggedPage)
from radixtier.storage.publisher import Publisher

HINTS = 65536  # remote page locations remembered between a lookup and the read that follows


@dataclass
class ReadResult:
    """A read's outcome: ok per page, and how many pages came from this partition and from other
    nodes' (the rest missed); lookup_s: time spent asking the index (0 when it was not asked) and
    found: the remote pages that lookup named."""

    ok: List[bool]
    local: int
    remote: int
    lookup_s: float = 0.0
    found: int = 0

    @property
    def missed(self) -> int:
        return len(self.ok) - self.local - self.remote


@dataclass
class WriteResult:
    """A write's outcome: the store's PutResult (ok, locations, evicted once) and the pages it
    freed outside the write since the last call and no longer holds (a read found them unproven,
    or a put that raised evicted them); both are unpublished and belong in the event stream's
    removals."""

    put: PutResult
    dropped: List[bytes]

    @property
    def removed(self) -> List[bytes]:
        return list(self.put.evicted) + self.dropped


class TierClient:
    """One node's tier 3 and prefix index (see module docstring). `index=None`: a node alone."""

    def __init__(self, store: PageStore, index: Optional[PrefixIndex]) -> None:
        self.store = store
        self.index = index
        self.publisher = Publisher(store, index)
        # remote locations as plain tuples of atoms (namespace, slot, generation, length, checksum):
        # the collector does not track them
        self._hints: "OrderedDict[bytes, LocationTuple]" = OrderedDict()
        self._hints_lock = threading.Lock()

    # ---------------------------------------------------------------- lookups
    def remote_locations(self, root: Optional[bytes], keys: Sequence[bytes]) -> List[LocationTuple]:
        """Locations of the leading run of `keys` (one chain under `root`; None: unknown) that other
        live nodes hold in this namespace, remembered for the read that follows."""
        if self.index is None or not keys:
            return []
        out = self.publisher.remote_locations(root, keys)
        with self._hints_lock:
            hints = self._hints
            for key, loc in zip(keys, out):
                hints[key] = loc
                hints.move_to_end(key)
            while len(hints) > HINTS:
                hints.popitem(last=False)
        return out

    def _timed_lookup(self, root: Optional[bytes], keys: Sequence[bytes]) -> Tuple[List[LocationTuple], float]:
        """remote_locations, and the seconds it took (for the caller's lookup metrics)."""
        t0 = time.perf_counter()
        out = self.remote_locations(root, keys)
        return out, time.perf_counter() - t0

    def leading_run(self, root: Optional[bytes], keys: Sequence[bytes]) -> Tuple[int, int, float]:
        """(pages held here from the first, pages after them that other live nodes hold, seconds
        the index lookup took -- 0 when the local run covered every key)."""
        local = self.store.leading_run(keys)
        if local == len(keys) or self.index is None:
            return local, 0, 0.0
        found, lookup_s = self._timed_lookup(root, keys[local:])
        return local, len(found), lookup_s

    def have(self, root: Optional[bytes], keys: Sequence[bytes], from_end: bool) -> Tuple[List[bool], int, float]:
        """(per page: held here or, through the index, by another node; pages the index named;
        seconds the lookup took -- 0 when every page is here). One lookup of the pages not held
        here, in chain order (an exact leading run) or from the end (exact for the longest trailing
        windows); pages past the first one nobody holds stay False (only under-reports)."""
        have = self.store.exists(keys)
        missing = [i for i, h in enumerate(have) if not h]
        if not missing or self.index is None:
            return have, 0, 0.0
        if from_end:
            missing.reverse()
        found, lookup_s = self._timed_lookup(root, [keys[i] for i in missing])
        for i, _loc in zip(missing, found):
            have[i] = True
        return have, len(found), lookup_s

    # ---------------------------------------------------------------- reads and writes
    def read(self, root: Optional[bytes], keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> ReadResult:
        """This partition first, then the pages after its leading run that other nodes hold: at the
        locations a lookup remembered, else from one index lookup now, read in one verified batch."""
        store = self.store
        ok = store.get(keys, buffers)
        local = sum(ok)
        if local == len(ok) or self.index is None:
            return ReadResult(ok, local, 0)
        first = ok.index(False)
        missing = [i for i in range(first, len(ok)) if not ok[i]]
        with self._hints_lock:
            locs = {i: loc for i in missing if (loc := self._hints.get(keys[i])) is not None}
        lookup_s, found = 0.0, 0
        if len(locs) < len(missing):  # not seen by a lookup: ask the index now
            named, lookup_s = self._timed_lookup(root, keys[first:])
            for j, loc in enumerate(named):
                locs.setdefault(first + j, loc)
            found = len(named)
        at = [i for i in missing if i in locs]
        remote = 0
        if at:
            got = store.read_locations([locs[i] for i in at], [keys[i] for i in at], [buffers[i] for i in at])
            for i, good in zip(at, got):
                ok[i] = good
                remote += good
        return ReadResult(ok, local, remote, lookup_s, found)

    def write(self, root: bytes, keys: Sequence[bytes], buffers: Sequence[BufferLike],
              parents: Optional[Sequence[Optional[bytes]]] = None,
              tags: Optional[Sequence[Optional[RouterTag]]] = None) -> WriteResult:
        """store.put (with each page's router tag, if given), then what follows it: the index told
        what the put stored and evicted (from the put's own result) and what the store dropped
        meanwhile."""
        res = self.store.put(keys, buffers, parents, tags)
        return WriteResult(res, self.after_put(root, keys, res))

    def after_put(self, root: bytes, keys: Sequence[bytes], res: PutResult) -> List[bytes]:
        """What follows a put (its caller ran it, e.g. on a transfer thread): unpublish what the
        store dropped outside it since the last call and does not hold again (a dropped page this
        or an earlier put stored anew keeps its record), then publish and unpublish from the put's
        result -- in that order, so the index's queue ends with what the store holds. Returns the
        dropped keys that are gone."""
        dropped = self.publisher.withdraw_dropped()
        self.publisher.stored(root, keys, res)
        return dropped

    def router_tags(self, batch_pages: int = 256) -> Iterator[List[TaggedPage]]:
        """What this partition holds, as a router names it, parents first (store.router_tags)."""
        return self.store.router_tags(batch_pages)

    def clear(self) -> List[bytes]:
        """Remove every page of this partition; returns their keys (unpublished here)."""
        keys = [k for k, _p, _l in self.store.entries()]
        self.store.clear()
        self.publisher.removed(keys)
        with self._hints_lock:
            self._hints.clear()
        return keys

    # ---------------------------------------------------------------- housekeeping
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the index has every record published so far."""
        return self.publisher.flush(timeout)

    def health(self) -> Optional[dict]:
        return self.publisher.health()

    def stats(self) -> dict:
        return self.store.stats()

    def close(self) -> None:
        """Close the index, then the store (the store last: the index may still read it)."""
        try:
            if self.index is not None:
                self.index.close()
        finally:
            self.store.close()
