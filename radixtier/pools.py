"""Fixed-size page pools: one tensor per tier, a slot per KV page.

The device pool lives on CUDA when present (cpu otherwise, for tests); the host pool is
pinned when CUDA is present so device<->host copies can run asynchronously on streams, and
otherwise on transparent huge pages (radixtier.hostmem), which tier-3 reads fill faster.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from radixtier.hostmem import host_memory

try:  # free() in one native pass (radixtier/_slotpool.c); numpy below where it was not built
    from radixtier._slotpool import free_slots as _native_free
except ImportError:  # pragma: no cover - depends on the build
    _native_free = None


class PoolExhausted(RuntimeError):
    """Raised when a pool has fewer free slots than asked for (callers evict, then retry)."""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when present else cpu; 'cuda' without CUDA is a configuration error."""
    if device == "auto":
        return torch.device("cuda" if cuda_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type == "cuda" and not cuda_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


HOST_ALIGN = 4096


def _allocate(num_pages: int, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
              pin: bool) -> torch.Tensor:
    """Zeroed pool tensor; on the host it starts on a 4 KiB boundary so O_DIRECT can read into its
    pages, and unpinned it is on transparent huge pages (see radixtier.hostmem: why)."""
    if device.type != "cpu":
        return torch.zeros((num_pages,) + shape, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = num_pages * elem
    for d in shape:
        nbytes *= d
    if pin:  # CUDA's pinned allocator (page-locked for async copies); not advised for huge pages
        raw = torch.zeros(nbytes + HOST_ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = (-raw.data_ptr()) % HOST_ALIGN
        raw = raw[skip:skip + nbytes]
    else:
        raw = host_memory(nbytes)
    return raw.view(dtype).view((num_pages,) + shape)


class PagePool:
    """`num_pages` slots of `page_shape` elements each, with a free-slot allocator."""

    def __init__(self, name: str, num_pages: int, page_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device, pin_memory: bool = False) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages <= 0:
            raise ValueError(f"{name}_pages: expected a positive integer, got {num_pages!r}")
        shape = tuple(int(d) for d in page_shape)
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"page_shape: expected positive dimensions, got {tuple(page_shape)!r}")
        self.name = name
        self.num_pages = num_pages
        self.page_shape = shape
        self.dtype = dtype
        self.device = device
        pin = bool(pin_memory and device.type == "cpu" and cuda_available())
        self.pinned = pin
        self.buffer = _allocate(num_pages, shape, dtype, device, pin)
        self.page_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self._lock = threading.Lock()
        # Free slots are a stack (the top `_num_free` entries of `_free`) and `_used` marks taken
        # ones: numpy arrays, so allocating or freeing a 2,000-page request is a few vector ops,
        # not a Python loop, and no per-slot Python object outlives the call.
        # Every array is written in full here (np.full, not np.zeros): a large zeroed array is mapped
        # lazily, and each 4 KiB page would then fault on its first write, inside a later free()
        # (measured: 25-35 us of a 2,048-slot free, more than the free's own work).
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        self._used = np.full(num_pages, False)
        # scratch for the numpy free()'s given-twice check (the native pass marks slots in `_used`)
        self._order = np.full(num_pages, -1, dtype=np.int32) if _native_free is None else None

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def alloc(self, n: int) -> np.ndarray:
        """n free slots (int64), lowest-numbered first on a fresh pool."""
        if n < 0:
            raise ValueError(f"{self.name} pool: cannot allocate {n} slots")
        with self._lock:
            top = self._num_free
            if n > top:
                raise PoolExhausted(f"{self.name} pool: need {n} free page slots, {top} of {self.num_pages} free")
            slots = self._free[top - n:top][::-1].copy()
            self._num_free = top - n
            self._used[slots] = True
            return slots

    def try_alloc(self, n: int) -> Optional[np.ndarray]:
        """alloc(n), or None when fewer than n slots are free (no exception: eviction asks often)."""
        if n > self._num_free:
            return None
        try:
            return self.alloc(n)
        except PoolExhausted:  # another thread took them meanwhile
            return None

    def free(self, slots: Sequence[int]) -> None:
        """Return slots; a slot out of range, not allocated, or given twice is an error and nothing
        is freed (a slot pushed twice would later be handed to two owners)."""
        arr = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        if arr.size:
            self.free_runs([arr])

    def free_runs(self, runs: Sequence[np.ndarray]) -> None:
        """free() of several C-contiguous int64 slot arrays at once (an eviction's victims), checked together:
        nothing is freed if any slot is bad, and nothing is concatenated first."""
        if not len(runs):
            return
        with self._lock:
            if _native_free is None:
                wrong = next((r for r in runs if r.dtype != np.int64 or not r.flags.c_contiguous), None)
                if wrong is not None:  # as the native pass checks
                    raise TypeError(f"{self.name} pool: free_runs: a run is not a contiguous int64 array "
                                    f"(dtype {wrong.dtype})")
                self._free_numpy(np.concatenate(runs) if len(runs) > 1 else runs[0])
                return
            try:
                self._num_free = _native_free(self._used, self._free, self._num_free, runs)
            except (ValueError, RuntimeError, TypeError) as exc:
                raise type(exc)(f"{self.name} pool: {exc}") from None

    def _free_numpy(self, arr: np.ndarray) -> None:
        """free() where the native pass is not built: the same checks, as numpy vector calls."""
        n = arr.size
        if n == 0:
            return
        outside = arr.view(np.uint64) >= self.num_pages  # a negative slot is a huge unsigned one
        if outside.any():
            bad = int(arr[np.argmax(outside)])
            raise ValueError(f"{self.name} pool: slot {bad} out of range 0..{self.num_pages - 1}")
        taken = self._used[arr]
        if not taken.all():
            raise RuntimeError(f"{self.name} pool: double free of slot {int(arr[np.argmin(taken)])}")
        if n > 1:
            positions = np.arange(n, dtype=np.int32)
            self._order[arr] = positions  # a slot given twice keeps only its last position
            seen = self._order[arr]
            if not np.array_equal(seen, positions):
                dup = int(arr[np.argmax(seen != positions)])
                raise RuntimeError(f"{self.name} pool: double free of slot {dup} (given twice in one call)")
        self._used[arr] = False
        top = self._num_free
        self._free[top:top + n] = arr
        self._num_free = top + n

    def index(self, slots: Sequence[int]) -> torch.Tensor:
        if isinstance(slots, torch.Tensor):  # e.g. slots a caller keeps on the GPU
            return slots.to(device=self.device, dtype=torch.long)
        arr = np.ascontiguousarray(slots, dtype=np.int64)
        return torch.from_numpy(arr).to(self.device)  # no copy on the CPU

    def page(self, slot: int) -> torch.Tensor:
        return self.buffer[slot]

    def read(self, slots: Sequence[int]) -> torch.Tensor:
        """Gather pages into a new tensor [len(slots), *page_shape] on the pool's device."""
        return self.buffer.index_select(0, self.index(slots))

    def write(self, slots: Sequence[int], pages: torch.Tensor) -> None:
        expected: Tuple[int, ...] = (len(slots),) + self.page_shape
        if tuple(pages.shape) != expected:
            raise ValueError(f"{self.name} pool write: expected pages of shape {expected}, got {tuple(pages.shape)}")
        self.buffer.index_copy_(0, self.index(slots), pages.to(device=self.device, dtype=self.dtype))
