"""What this node's store holds, told to the prefix index; what other nodes hold, asked of it.

The one place both serving paths go through for the index: `TieredKVCache` (embedded) and
`RadixTierStorage` (SGLang) publish what a put stored and unpublish what it evicted (from the
put's own result: no trip back to the store), and
ask for the leading run of a chain that other live nodes hold in the same namespace. The
index is advisory: every failure here is logged and becomes "nothing remote", never an
exception into serving, and a remote record is never trusted until the slot header proves it.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from radixtier.storage.api import (STORAGE_TIER, LocationTuple, PageLocation, PageRecord, PageStore, PrefixIndex,
                                   PutResult)

log = logging.getLogger("radixtier.storage.publisher")


def store_records(store: PageStore, node_id: str) -> Iterator[Tuple[bytes, bytes, PageRecord]]:
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
        yield root_of(key), key, PageRecord(node_id, STORAGE_TIER, loc)


class Publisher:
    """One store's side of the prefix index (see module docstring). `index=None`: a node alone."""

    def __init__(self, store: PageStore, index: Optional[PrefixIndex]) -> None:
        self.store = store
        self.index = index
        if index is not None:  # after a restart (or an outage) the index is told again what the store holds
            index.set_republisher(lambda: store_records(store, index.node_id))

    def stored(self, root: bytes, keys: Sequence[bytes], result: PutResult) -> None:
        """Tell the index what one put did: publish the pages of one chain (under its root page)
        that the store now holds, at the locations the put reported, and unpublish the pages it
        evicted to make room (each once, as the result names them)."""
        index = self.index
        if index is None:
            return
        try:
            if result.evicted:
                index.unpublish(list(result.evicted))
            pub, recs = [], []
            node = index.node_id
            for key, loc in zip(keys, result.locations):
                if loc is not None:
                    pub.append(key)
                    recs.append(PageRecord(node, STORAGE_TIER, PageLocation(*loc)))
            if pub:
                index.publish(root, pub, recs)
        except Exception as exc:  # the index is advisory: serving goes on without it
            log.warning("radixtier: prefix index publish failed: %s", exc)

    def removed(self, keys: Sequence[bytes]) -> None:
        """The store no longer holds these pages (deleted, cleared, found corrupt)."""
        if self.index is None or not keys:
            return
        try:
            self.index.unpublish(list(keys))
        except Exception as exc:
            log.warning("radixtier: prefix index unpublish failed: %s", exc)

    def withdraw_dropped(self) -> List[bytes]:
        """What the store dropped outside a put's result since the last call (pages a read found
        unproven, a raising put's victims) and does not hold again -- a page stored anew since keeps
        its record -- unpublished here; returns those keys for the caller's own bookkeeping (the
        embedded tree, the KV-event stream). Store calls take only the store's own locks."""
        store = self.store
        dropped = store.take_dropped()
        if not dropped:
            return []
        gone = [key for key, here in zip(dropped, store.exists(dropped)) if not here]
        self.removed(gone)
        return gone

    def remote_run(self, root: Optional[bytes], keys: Sequence[bytes]) -> List[PageRecord]:
        """Records for the leading run of `keys` (one chain under `root`; None when the caller does
        not know where the chain starts) that other live nodes hold in this store's namespace; []
        when there is no index or it cannot answer."""
        if self.index is None or not keys:
            return []
        try:
            runs = self.index.lookup(root, keys)
        except Exception as exc:  # the index must never break serving
            log.warning("radixtier: prefix index lookup failed, serving from local pages: %s", exc)
            return []
        uuid = self.store.uuid
        out: List[PageRecord] = []
        for recs in runs:
            rec = next((r for r in recs if r.tier == STORAGE_TIER and r.location.namespace == uuid), None)
            if rec is None:
                break
            out.append(rec)
        return out

    def remote_locations(self, root: Optional[bytes], keys: Sequence[bytes]) -> List[LocationTuple]:
        """remote_run's fast path: (namespace, slot, generation, length, checksum) per page of the
        leading run, decoded in bulk by the index (the SGLang backend's batch_exists and reads)."""
        if self.index is None or not keys:
            return []
        try:
            return self.index.lookup_locations(root, keys, self.store.uuid)
        except Exception as exc:  # the index must never break serving
            log.warning("radixtier: prefix index lookup failed, serving from local pages: %s", exc)
            return []

    def flush(self, timeout: float = 10.0) -> bool:
        return True if self.index is None else self.index.flush(timeout)

    def health(self) -> Optional[Dict[str, object]]:
        return None if self.index is None else self.index.health()
