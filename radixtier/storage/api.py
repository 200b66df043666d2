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


@dataclass
class PutResult:
    ok: List[bool]
    evicted: List[bytes] = field(default_factory=list)  # keys dropped to make room, in eviction order
    already_stored: int = 0  # ok pages the store held before this call (nothing written for them)
    written: int = 0  # pages this call wrote (a key twice in one batch is written once)


@dataclass(frozen=True)
class PageRecord:
    """One node's claim that it holds a page, and where (for tier 3: a verifiable slot location)."""

    node_id: str
    tier: str
    location: PageLocation


@runtime_checkable
class PageStore(Protocol):
    """Tier 3: pages by 16-byte key, each read proven (header + checksum) before it is reported ok."""

    page_bytes: int
    capacity_pages: int
    uuid: str
    partition: int

    def put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
            parents: Optional[Sequence[Optional[bytes]]] = None) -> PutResult: ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]: ...

    def exists(self, keys: Sequence[bytes]) -> List[bool]: ...

    def leading_run(self, keys: Sequence[bytes]) -> int: ...

    def location(self, key: bytes) -> Optional[PageLocation]: ...

    def read_location(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def clear(self) -> int: ...

    def touch(self, keys: Sequence[bytes]) -> None: ...

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None: ...

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]: ...

    def take_evicted(self) -> List[bytes]: ...

    def stats(self) -> Dict[str, object]: ...

    def register_memory(self, regions: Sequence[Tuple[int, int]]) -> bool: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


Republisher = Callable[[], Iterable[Tuple[bytes, bytes, PageRecord]]]  # yields (root, key, record)


@runtime_checkable
class PrefixIndex(Protocol):
    """Which page hashes exist anywhere in the fleet. Keys are page hashes; a chain's pages are
    published under the chain's root page hash so a whole chain is looked up at once."""

    node_id: str

    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None: ...

    def unpublish(self, keys: Sequence[bytes]) -> None: ...

    def lookup(self, root: Optional[bytes], keys: Sequence[bytes],
               exclude_self: bool = True) -> List[List[PageRecord]]:
        """Records of the leading run of `keys` (one chain) held by other live nodes. root=None:
        the caller does not know the chain's first page; the index finds it from keys[0]."""

    def lookup_locations(self, root: Optional[bytes], keys: Sequence[bytes],
                         namespace: str) -> List[LocationTuple]:
        """Per page of the leading run of `keys` that another live node holds in tier 3 of
        `namespace`: (namespace, slot, generation, length, checksum) -- lookup()'s fast path."""

    def set_republisher(self, fn: Republisher) -> None:
        """What to publish again after a restart or an outage (the index calls it when it must)."""

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued publishes took effect; False if they could not in time."""

    def health(self) -> Dict[str, object]:
        """At least `up` (lookups answered) and `queue_depth`; implementations add their counters."""

    def close(self) -> None: ...


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
