"""The tier-3 page store interface the tree's mover and the SGLang plugin both talk to."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import numpy as np

# A page buffer: a contiguous CPU torch tensor, any writable buffer-protocol object, or (address, nbytes).
BufferLike = Union[Any, Tuple[int, int]]


@dataclass(frozen=True)
class PageLocation:
    """Where a page sits in a (possibly shared) namespace; enough for any node to read and verify it."""

    namespace: str  # the namespace's uuid (hex)
    slot: int
    generation: int
    length: int
    checksum: int


@dataclass
class PutResult:
    ok: List[bool]
    evicted: List[bytes] = field(default_factory=list)  # keys dropped to make room, in eviction order


@runtime_checkable
class PageStore(Protocol):
    page_bytes: int
    capacity_pages: int
    uuid: str

    def put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
            parents: Optional[Sequence[Optional[bytes]]] = None) -> PutResult: ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]: ...

    def exists(self, keys: Sequence[bytes]) -> List[bool]: ...

    def leading_run(self, keys: Sequence[bytes]) -> int: ...

    def location(self, key: bytes) -> Optional[PageLocation]: ...

    def read_location(self, location: PageLocation, key: bytes, buffer: BufferLike) -> bool: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def touch(self, keys: Sequence[bytes]) -> None: ...

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None: ...

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]: ...

    def take_evicted(self) -> List[bytes]: ...

    def close(self) -> None: ...


def buffer_view(buf: BufferLike, nbytes: Optional[int] = None) -> memoryview:
    """A writable byte view over a page buffer without copying it."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        addr, size = buf
        if addr == 0 or size < 0:
            raise ValueError(f"buffer: invalid (address, nbytes) = ({addr:#x}, {size})")
        return memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
    try:
        import torch

        if isinstance(buf, torch.Tensor):
            if buf.device.type != "cpu":
                raise ValueError(f"buffer: tier-3 I/O needs host tensors, got a tensor on {buf.device}")
            if not buf.is_contiguous():
                raise ValueError("buffer: tensor must be contiguous")
            size = buf.numel() * buf.element_size()
            if size == 0:
                return memoryview(bytearray(0))
            return memoryview((ctypes.c_char * size).from_address(buf.data_ptr())).cast("B")
    except ImportError:  # pragma: no cover
        pass
    mv = memoryview(buf)
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def buffer_address(buf: BufferLike) -> Tuple[int, int]:
    """(address, nbytes) of a page buffer, for alignment checks."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(isinstance(x, int) for x in buf):
        return buf
    mv = buffer_view(buf)
    if mv.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data), mv.nbytes
