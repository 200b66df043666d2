"""Transfers as objects, and starting them: one small record per batch of pages that moves.

A transfer (`Promote`, `Load`, `Backup`, `Write`, `Spill`) carries everything its outcome needs:
the node it was started for, the pages' keys (which find the nodes again if the tree split the
node meanwhile) and the slots it copies into. It is made by `Launcher.start_*` and never changed
after that. The copy itself is queued on the transfer engine, whose future is the transfer's
handle (returned to the caller, recorded in the in-flight table); when that future finishes,
the transfer and its future are handed to the one point that applies outcomes (the façade's
`_apply`). The record does not hold its future, so a finished transfer leaves no reference cycle.

`Launcher` is called with the cache lock held (by the planner, the writer and the evictor). It
submits the copy to the transfer engine (which only queues it: nothing here waits on I/O),
records the transfer in the in-flight table and registers its acknowledgement. It changes no
tree slot itself; the only tree changes here are the locks that keep a transfer's source pages
in place (`Backup`, `Write`), which the outcome releases. It calls none of the other parts.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, ClassVar, List, Optional, Sequence, Union

import torch

from radixtier.cache.inflight import BACKING, LOADING, PROMOTING, WRITING
from radixtier.cache.state import CacheState
from radixtier.storage.api import PageRecord
from radixtier.tiers import Tier
from radixtier.tree import Node, RadixTree


@dataclass(eq=False)
class Promote:
    """storage/remote -> host, into `node`'s new host `slots` (the planner's prefetch)."""

    KIND: ClassVar[str] = PROMOTING
    node: Node
    keys: List[bytes]
    slots: List[int]
    source: Tier  # Tier.STORAGE or Tier.REMOTE


@dataclass(eq=False)
class Load:
    """host -> device, into `node`'s new device `slots` (the planner's load)."""

    KIND: ClassVar[str] = LOADING
    node: Node
    keys: List[bytes]
    slots: List[int]


@dataclass(eq=False)
class Backup:
    """device -> host, into `node`'s new host `slots`; then on to tier 3 when `to_storage` (the writer)."""

    KIND: ClassVar[str] = BACKING
    node: Node  # locked by the launcher until the outcome is applied
    keys: List[bytes]
    slots: List[int]
    to_storage: bool


@dataclass(eq=False)
class Write:
    """host -> tier 3, from `node`'s host slots (the writer)."""

    KIND: ClassVar[str] = WRITING
    node: Node  # locked by the launcher until the outcome is applied
    keys: List[bytes]


@dataclass(eq=False)
class Spill:
    """An evicted node's staged pages -> tier 3 (the evictor). The node stays in the tree (busy:
    the in-flight table's spill mark) until the outcome is applied, so tier 3's copy is found."""

    KIND: ClassVar[str] = WRITING
    node: Node
    keys: List[bytes]
    root: bytes  # the chain's page 0, under which the index groups the records


Transfer = Union[Promote, Load, Backup, Write, Spill]


def root_of(tree: RadixTree, node: Node) -> bytes:
    """The chain's page 0, under which the index groups a chain's records (cache lock held)."""
    return tree.page_keys(tree.path_to_root(node)[0])[0]


def parents(tree: RadixTree, node: Node) -> List[Optional[bytes]]:
    """Each page's parent key (the previous page of the chain), for tier 3's leaves-first order."""
    above = tree.page_keys(node.parent) if node.parent is not None else []
    return [above[-1] if above else None] + list(tree.page_keys(node)[:-1])


class Launcher:
    """Starts transfers (cache lock held); `on_done` receives each one with its future once that
    finished, on the thread that finished it, before flush() stops counting it as in flight."""

    def __init__(self, state: CacheState, on_done: Callable[[Transfer, Future], None]) -> None:
        self.s = state
        self._on_done = on_done

    def start_promotion(self, node: Node, slots: List[int], source: Tier,
                        records: Optional[Sequence[PageRecord]] = None) -> Future:
        s = self.s
        keys = list(s.tree.page_keys(node))
        if source == Tier.STORAGE:
            fut = s.mover.storage_to_host(keys, slots)
        else:
            fut = s.mover.remote_to_host([r.location for r in records or []], keys, slots)
        return self._track(Promote(node, keys, slots, source), fut)

    def start_load(self, node: Node, slots: List[int]) -> Future:
        s = self.s
        keys = list(s.tree.page_keys(node))
        return self._track(Load(node, keys, slots), s.mover.host_to_device(list(node.host), slots))

    def start_backup(self, node: Node, slots: List[int], to_storage: bool) -> Future:
        s = self.s
        s.tree.lock(node)  # the source pages must not move while they are read
        keys = list(s.tree.page_keys(node))
        return self._track(Backup(node, keys, slots, to_storage), s.mover.device_to_host(list(node.device), slots))

    def start_write(self, node: Node) -> Future:
        s = self.s
        s.tree.lock(node)
        keys = list(s.tree.page_keys(node))
        fut = s.mover.host_to_storage(list(node.host), keys, parents(s.tree, node))
        return self._track(Write(node, keys), fut)

    def start_spill(self, node: Node, staged: torch.Tensor) -> Future:
        """Write a staged copy of an evicted node's pages down; the node stays in the tree (busy)
        until the write is applied, so tier 3's copy is found again."""
        s = self.s
        keys = list(s.tree.page_keys(node))
        root = root_of(s.tree, node)
        pars = parents(s.tree, node)
        s.inflight.begin_spill(node)
        return self._track(Spill(node, keys, root), s.mover.pages_to_storage(staged, keys, pars))

    def _track(self, op: Transfer, fut: Future) -> Future:
        s = self.s
        s.inflight.put(op.KIND, op.node, fut)
        on_done = self._on_done
        s.inflight.track(fut, lambda f: on_done(op, f))
        return fut
