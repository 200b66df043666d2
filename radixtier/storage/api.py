"""The storage layer's contracts: the tier-3 PageStore and the cross-node PrefixIndex.

Both serving paths talk to storage only through these protocols: the embedded
`TieredKVCache` (through its transfer engine) and the SGLang backend `RadixTierStorage`.
They are complete, so no caller probes an implementation with getattr/hasattr.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, Union,
                    runtime_checkable)

import numpy as np

KEY_BYTES = 16  # every page key, in every tier, index and namespace, is this long (radixtier.hashing makes them)

# A page buffer: a contiguous CPU torch tensor, any writable buffer-protocol object, or (address, nbytes).
BufferLike = Union[Any, Tuple[int, int]]

# The `tier` of a PageRecord on the wire: the labels of radixtier.tiers.Tier (tests pin that they agree).
STORAGE_TIER = "storage"  # a tier-3 page, readable by any node sharing the namespace
HOST_TIER = "host"  # a page in a node's host memory


@dataclass(frozen=True)
class PageLocation:
    """Where a page sits in a (possibly shared) namespace; enough for any node to read and verify it."""

    namespace: str  # the namespace's uuid (hex)
    slot: int
    generation: int
    length: int
    checksum: int


# A PageLocation's fields as a plain tuple (namespace, slot, generation, length, checksum): what bulk
# lookups return, so a 512-page answer builds no per-page objects until a page is actually read.
LocationTuple = Tuple[str, int, int, int, int]


# What a KV-aware router's BlockStored names a page by: (the engine's block hash, its parent's block
# hash or None, the page's token ids). A store may keep it with the page (PageStore.put's `tags`).
RouterTag = Tuple[int, Optional[int], Sequence[int]]
# A page named back from a store (PageStore.router_tags): (key, block hash, parent block hash or None,
# token ids).
TaggedPage = Tuple[bytes, int, Optional[int], List[int]]


@dataclass
class PutResult:
    """What one put did -- each fact once, so callers tell the index and the event stream from it
    without asking the store again."""

    ok: List[bool]  # per key: stored (written now, or already)
    evicted: List[bytes] = field(default_factory=list)  # keys dropped to make room, in eviction order, each once
    already_stored: int = 0  # ok pages the store held before this call (nothing written for them)
    written: int = 0  # pages this call wrote (a key twice in one batch is written once)
    locations: List[Optional[LocationTuple]] = field(default_factory=list)  # per key: where it is stored, or None


@dataclass(frozen=True)
class PageRecord:
    """One node's claim that it holds a page, and where (for tier 3: a verifiable slot location)."""

    node_id: str
    tier: str
    location: PageLocation


@runtime_checkable
class PageStore(Protocol):
    """Tier 3: pages by 16-byte key, each read proven (slot header and checksum) before it is
    reported ok. Thread-safe; every call may run on any transfer thread.

    Failure, for every method: a bad argument (a key that is not 16 bytes, lists of different
    lengths, a buffer of the wrong size) raises ValueError naming it, before any I/O; an I/O error or
    a page that fails proof is a per-page miss (False), counted and logged, never an exception and
    never wrong bytes; a call after close() raises RuntimeError."""

    page_bytes: int  # the largest page a slot holds
    capacity_pages: int  # slots of this partition
    uuid: str  # the namespace's uuid (hex): a PageLocation elsewhere than here is refused
    partition: int  # the partition this store writes

    def put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
            parents: Optional[Sequence[Optional[bytes]]] = None,
            tags: Optional[Sequence[Optional[RouterTag]]] = None) -> PutResult:
        """Store pages: keys[i]'s bytes are buffers[i] (a tensor, a buffer, (address, nbytes) or a
        list of segments); parents[i] the key of the page before it in its chain (None: a chain's
        first page, or unknown), which the eviction order follows (leaves first); tags[i] what a
        router calls the page (kept with it where the store can, for router_tags). Returns ok per
        key (durable and indexed, or held already), the location of each stored page and the keys
        evicted to make room (each once, in order). A full store of pages being read stores the
        leading part of the batch; a lease this store no longer holds stores nothing."""

    def router_tags(self, batch_pages: int = 256) -> Iterator[List[TaggedPage]]:
        """The held pages written with a tag, as a router names them, parents before children, in
        batches of at most batch_pages; each proven held when named. Empty for a store that keeps
        no tags; ends early once the store closes."""

    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        """Read pages into caller buffers: ok[i] only once page i's slot header and checksum proved
        it (False: not held here, or failed proof; a page that fails proof is freed and later
        named by take_dropped)."""

    def read_locations(self, locations: Sequence[Union[PageLocation, LocationTuple]], keys: Sequence[bytes],
                       buffers: Sequence[BufferLike]) -> List[bool]:
        """Read pages by where another node says they are (PageLocation or LocationTuple), in one
        batch: ok[i] only once the slot header proves keys[i] at that generation and the checksum
        matches. A location in another namespace, outside the slots or of another size is False."""

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        """Per key: held here now (no I/O)."""

    def leading_run(self, keys: Sequence[bytes]) -> int:
        """How many of keys, from the first, are held here (no I/O)."""

    def location(self, key: bytes) -> Optional[PageLocation]:
        """Where a held page is (for other nodes to read), or None."""

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages (a page being read stays); returns how many were removed."""

    def clear(self) -> int:
        """Remove every page; returns how many were removed."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a use of these pages for the eviction order (unknown keys are ignored)."""

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None:
        """A faster tier holds (or no longer holds) these pages: held pages are evicted first."""

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]:
        """(key, parent, location) of every held page, as of one moment."""

    def take_dropped(self) -> List[bytes]:
        """Keys this store freed outside a put since the last call (a read found them unproven);
        a put's evictions are in its PutResult only."""

    def stats(self) -> Dict[str, object]:
        """Counters and geometry (pages, bytes, errors by kind, evictions by reason, engine)."""

    def register_memory(self, regions: Sequence[Tuple[int, int]]) -> bool:
        """Host memory reads land in, as (address, nbytes), registered with the I/O engine once;
        [] gives it back. False where the engine cannot (logged): reads work either way."""

    def __len__(self) -> int:
        """Pages held."""

    def close(self) -> None:
        """Refuse new calls, wait for running ones, release the partition."""


Republisher = Callable[[], Iterable[Tuple[bytes, bytes, PageRecord]]]  # yields (root, key, record)


@runtime_checkable
class PrefixIndex(Protocol):
    """Which page hashes exist anywhere in the fleet. Keys are page hashes; a chain's pages are
    published under the chain's root page hash so a whole chain is looked up at once.

    The index is advisory, and every method says so by how it fails: writes are queued and
    applied in the background (an unreachable index drops them, counted in health()); lookups
    answer within their timeout or return no records; no method raises because the index is
    down. A record is never trusted by a reader: the page's slot header proves it."""

    node_id: str  # this process's identity in the index (one live process each)

    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        """Record that this node holds keys[i] at records[i], under the chain's root page (queued)."""

    def unpublish(self, keys: Sequence[bytes]) -> None:
        """Withdraw this node's records of these pages (queued)."""

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes],
               exclude_self: bool = True) -> List[List[PageRecord]]:
        """Records of the leading run of `keys` (one chain) held by other live nodes: one list per
        page of the run, [] when nobody holds keys[0] or the index cannot answer in time. root=None:
        the caller does not know the chain's first page; the index finds it from keys[0]."""

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes],
                         namespace: str) -> List[LocationTuple]:
        """Per page of the leading run of `keys` that another live node holds in tier 3 of
        `namespace`: (namespace, slot, generation, length, checksum) -- lookup()'s fast path
        (decoded in bulk, no object per page); [] when the index cannot answer in time."""

    def set_republisher(self, fn: Republisher) -> None:
        """What to publish again after a restart or an outage (the index calls it when it must)."""

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes took effect; False if they could not in time."""

    def health(self) -> Dict[str, object]:
        """At least `up` (lookups answered) and `queue_depth`; implementations add their counters."""

    def close(self) -> None:
        """Stop background work and give up this node's liveness (its records lapse)."""


def buffer_view(buf: BufferLike, nbytes: Optional[int] = None) -> memoryview:
    """A writable byte view over a page buffer without copying it."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        addr, size = buf
        if addr == 0 or size < 0:
            raise ValueError(f"buffer: invalid (address, nbytes) = ({addr:#x}, {size})")
        return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(buf, tensor):
        addr, size = _host_tensor_span(buf)
        if size == 0:
            return memoryview(bytearray(0))
        return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
    mv = memoryview(buf)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class PageSegments(Sequence):
    """Pages given as flat (address, nbytes) lists, `per_page` consecutive segments a page -- the
    form SGLang's host pool hands out (get_page_buffer_meta: K and V of every layer of a page).

    Why a type of its own: the native core takes the flat lists in one step, where a list of
    segment lists costs a Python tuple per segment and a walk per page (at 32 KiB pages that
    was most of a batch's time). Indexing gives page i's segment list, for the Python path."""

    __slots__ = ("addresses", "sizes", "per_page")

    def __init__(self, addresses: Sequence[int], sizes: Sequence[int], pages: int) -> None:
        if pages <= 0 or len(addresses) != len(sizes) or len(addresses) % pages:
            raise ValueError(f"host pool returned {len(addresses)} pointers and {len(sizes)} sizes for {pages} pages")
        self.addresses, self.sizes, self.per_page = addresses, sizes, len(addresses) // pages

    def __len__(self) -> int:
        return len(self.addresses) // self.per_page

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"page {i} of {len(self)}")
        lo = (i % len(self)) * self.per_page
        return [(int(a), int(n)) for a, n in zip(self.addresses[lo:lo + self.per_page], self.sizes[lo:lo + self.per_page])]


def native_buffer(buf: object) -> object:
    """A page (or segment list) as the native core takes it: tensors become (address, nbytes) after
    the same checks as buffer_view's; buffers, (address, nbytes) pairs and lists pass through. Called
    once per page on the read path, so the common cases are tested first and cheaply."""
    if isinstance(buf, tuple):
        if len(buf) == 2 and type(buf[0]) is int and type(buf[1]) is int:
            return buf
        return [native_buffer(b) for b in buf]
    if isinstance(buf, list):
        return [native_buffer(b) for b in buf]
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(buf, tensor):
        addr, n = _host_tensor_span(buf)
        return (addr, n) if n else bytearray(0)
    return buf


def _host_tensor_span(t) -> Tuple[int, int]:
    """(address, nbytes) of a tensor tier-3 I/O may use: on the host and contiguous, else ValueError."""
    if not t.is_cpu:
        raise ValueError(f"buffer: tier-3 I/O needs host tensors, got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError("buffer: tensor must be contiguous")
    return t.data_ptr(), t.nbytes


_TENSOR: list = []


def _torch_tensor_type():
    """torch.Tensor once torch is imported by anyone (the store itself never needs torch)."""
    if not _TENSOR:
        import sys

        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _TENSOR.append(torch.Tensor)
    return _TENSOR[0]


def buffer_address(buf: BufferLike) -> Tuple[int, int]:
    """(address, nbytes) of a page buffer, for alignment checks."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        return buf
    mv = buffer_view(buf)
    if mv.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data), mv.nbytes
