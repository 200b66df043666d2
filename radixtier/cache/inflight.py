"""Transfers in flight, owned by the cache (not by tree nodes), as SGLang's controller keeps ongoing_*.

Two kinds of state, two owners of synchronisation:
- which node has which transfer running (`PROMOTING`, `LOADING`, `BACKING`, `WRITING`) and which
  nodes an insert is filling: read and written only under the cache lock, keyed by node id
  (entries are added by the launcher and the façade's insert, removed by the outcomes);
- every future whose completion has not been applied yet (`track`, by the launcher): its own
  condition, a leaf lock, so `flush()` can wait without the cache lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Callable, Dict, Optional, Set

from radixtier.tree import Node

log = logging.getLogger("radixtier.cache")

PROMOTING = "promoting"  # storage/remote -> host into the node
LOADING = "loading"  # host -> device
BACKING = "backing"  # device -> host backup
WRITING = "writing"  # host (or a spill's staged copy) -> storage
KINDS = (PROMOTING, LOADING, BACKING, WRITING)


class InFlight:
    """The cache's table of running transfers (see module docstring)."""

    def __init__(self) -> None:
        self._by_kind: Dict[str, Dict[int, Future]] = {k: {} for k in KINDS}
        self._filling: Dict[int, int] = {}  # node id -> inserts placing KV under it
        self._spilling: Set[int] = set()  # nodes whose staged pages are being written down
        self._pending: Set[Future] = set()
        self._cv = threading.Condition(threading.Lock())

    # ---------------------------------------------------------------- node table (cache lock held)
    def get(self, kind: str, node: Node) -> Optional[Future]:
        return self._by_kind[kind].get(node.id)

    def put(self, kind: str, node: Node, fut: Future) -> None:
        self._by_kind[kind][node.id] = fut

    def clear(self, kind: str, node: Node, fut: Future) -> None:
        """Forget `fut` for `node` (only if it is still the node's transfer of that kind)."""
        table = self._by_kind[kind]
        if table.get(node.id) is fut:
            del table[node.id]

    def begin_fill(self, node: Node) -> None:
        self._filling[node.id] = self._filling.get(node.id, 0) + 1

    def end_fill(self, node: Node) -> None:
        n = self._filling.get(node.id, 0) - 1
        if n > 0:
            self._filling[node.id] = n
        else:
            self._filling.pop(node.id, None)

    def begin_spill(self, node: Node) -> None:
        self._spilling.add(node.id)

    def end_spill(self, node_id: int) -> None:
        self._spilling.discard(node_id)

    def busy(self, node: Node) -> bool:
        """Work in flight that needs the node to stay in the tree (the tree's prune/materialize hook)."""
        i = node.id
        return (i in self._by_kind[PROMOTING] or i in self._by_kind[LOADING] or i in self._filling
                or i in self._spilling)

    def on_split(self, node: Node, head: Node) -> None:
        """The tree split `node`: its first pages are now `head`, which shares its transfers."""
        for table in self._by_kind.values():
            fut = table.get(node.id)
            if fut is not None:
                table[head.id] = fut
        # an insert's fill mark stays on the node it named (end_fill names it); the head cannot be
        # pruned meanwhile anyway, since the filled node hangs under it
        if node.id in self._spilling:
            self._spilling.add(head.id)

    # ---------------------------------------------------------------- completions (own lock)
    def track(self, fut: Future, on_done: Callable[[Future], None]) -> None:
        """Run on_done when fut finishes (on the transfer's thread); until it has run, fut counts as
        in flight for flush() and applied()."""
        with self._cv:
            self._pending.add(fut)

        def done(f: Future) -> None:
            try:
                on_done(f)
            except Exception:  # pragma: no cover - a bookkeeping bug must not kill the worker silently
                log.exception("radixtier: transfer completion failed")
            finally:
                with self._cv:
                    self._pending.discard(f)
                    self._cv.notify_all()

        fut.add_done_callback(done)

    def applied(self, fut: Future, timeout: float = 30.0) -> None:
        """Wait until fut's completion has been applied to the cache."""
        with self._cv:
            self._cv.wait_for(lambda: fut not in self._pending, timeout=timeout)

    def flush(self, timeout: Optional[float]) -> bool:
        """Wait until every tracked transfer (and what its completion chained) has been applied."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                pending = list(self._pending)
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            wait_futures(pending, timeout=left)
            with self._cv:  # let completion callbacks run their bookkeeping
                self._cv.wait_for(lambda: not (set(pending) & self._pending), timeout=0.5)
