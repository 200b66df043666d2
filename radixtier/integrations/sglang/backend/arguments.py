"""What SGLang hands the backend, checked before any of it becomes an address or an I/O.

A host index is turned into a memory address by SGLang's zero-copy walk with no bounds check of
its own, so every call's host_indices are proven here first (whole, aligned pages inside the
registered pool); a refused call fails whole, and refusals are logged at a bounded rate.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Dict, NoReturn, Tuple

import torch

log = logging.getLogger("radixtier.sglang")

REFUSAL_LOG_EVERY_S = 30.0  # one log line per call kind and argument in this long, however many calls are refused


class ArgumentError(ValueError):
    """An argument SGLang would never send (host_indices outside the pool, of the wrong type or
    count): the call fails whole, before any I/O, and is logged through RefusalLog."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RefusalLog:
    """At most one error line per (call, argument) every `every_s` seconds, with the count of the
    refusals it stood for: a caller stuck on a bad index must not flood the log (each refusal is
    still counted in radixtier_stats()["errors"])."""

    def __init__(self, every_s: float = REFUSAL_LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last: Dict[Tuple[str, str], Tuple[float, int]] = {}  # -> (time logged, refusals not logged since)

    def refused(self, op: str, pages: int, exc: ArgumentError) -> None:
        now = time.monotonic()
        key = (op, exc.field)
        with self._lock:
            logged, quiet = self._last.get(key, (None, 0))
            if logged is not None and now - logged < self.every_s:
                self._last[key] = (logged, quiet + 1)
                return
            self._last[key] = (now, 0)
        more = f" ({quiet} more refused like it in the last {now - logged:.0f} s)" if quiet else ""
        log.error("radixtier: %s of %d page(s) refused, nothing read or written: %s%s", op, pages, exc, more)


def require_keys(keys: Any, field: str = "keys") -> None:
    """SGLang passes page hashes as a list; anything else (None, a generator, one string) is a
    caller's mistake that no per-key result can answer, so it is refused by name, up front."""
    if not isinstance(keys, (list, tuple)):
        raise ValueError(f"{field}: expected a list of page hash strings, got {type(keys).__name__}")


def check_host_indices(host_indices: Any, pages: int, page_size: int, slots: int, pool: str) -> torch.Tensor:
    """host_indices as a flat int64 tensor, once proven to be `pages` whole pages of the pool:
    each page `page_size` consecutive slots from a multiple of page_size, all of them in 0..slots-1.

    Why: SGLang's zero-copy walk turns a page's first slot into an address with no bounds check
    of its own, so a slot past the pool had a read write 32 KiB of someone else's memory and
    2**40 crashed the process. Alignment is required in every layout: SGLang's allocator hands out
    aligned pages only, and several pools (page_first_direct, DSA, ...) divide the slot by
    page_size, so an unaligned one names another page. Whole-tensor torch ops, no per-page Python."""
    if not isinstance(host_indices, torch.Tensor):
        raise ArgumentError("host_indices", f"host_indices: expected a tensor of host pool slots, got "
                                            f"{type(host_indices).__name__}")
    if host_indices.dtype.is_floating_point or host_indices.dtype.is_complex or host_indices.dtype == torch.bool:
        raise ArgumentError("host_indices", f"host_indices: expected an integer tensor, got dtype "
                                            f"{str(host_indices.dtype).replace('torch.', '')}")
    if host_indices.numel() != pages * page_size:
        raise ArgumentError("host_indices", f"host_indices: expected {pages * page_size} token slots for {pages} "
                                            f"pages, got {host_indices.numel()}")
    flat = host_indices.reshape(-1)
    if flat.dtype != torch.int64 or flat.device.type != "cpu":  # slots of a host pool: CPU int64 (a no-op for SGLang's)
        flat = flat.to(device="cpu", dtype=torch.int64)
    if page_size == 1:
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= slots:
            _refuse_host_indices(flat, page_size, slots, pool)
        return flat
    rows = flat.reshape(pages, page_size) - _page_offsets(page_size)  # a good page: its first slot, repeated
    starts = rows[:, 0]
    lo, hi = torch.aminmax(starts)
    if (int(lo) < 0 or int(hi) > slots - page_size or not torch.equal(rows, starts[:, None].expand(pages, page_size))
            or bool(torch.remainder(starts, page_size).any())):
        _refuse_host_indices(flat, page_size, slots, pool)
    return flat


@functools.lru_cache(maxsize=None)
def _page_offsets(page_size: int) -> torch.Tensor:
    """0..page_size-1, made once per page size (never written: the check only reads it)."""
    return torch.arange(page_size, dtype=torch.int64)


def _refuse_host_indices(flat: torch.Tensor, page_size: int, slots: int, pool: str) -> NoReturn:
    """Name the first bad slot and why (the refusal path only; the checks above stay vectorised)."""
    where = f"host pool {pool!r} ({slots} slots, page_size {page_size})"
    outside = ((flat < 0) | (flat >= slots)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ArgumentError("host_indices", f"host_indices: expected slots 0..{slots - 1} of {where}, got "
                                            f"{int(flat[i])} at position {i}")
    starts = flat[::page_size]
    unaligned = torch.remainder(starts, page_size).nonzero()
    if unaligned.numel():
        p = int(unaligned[0])
        raise ArgumentError("host_indices", f"host_indices: expected each page to start at a multiple of "
                                            f"page_size in {where}, got {int(starts[p])} at position "
                                            f"{p * page_size}")
    want = (starts[:, None] + _page_offsets(page_size)).reshape(-1)
    i = int((flat != want).nonzero()[0])
    raise ArgumentError("host_indices", f"host_indices: expected {page_size} consecutive slots per page in "
                                        f"{where}, got {int(flat[i])} at position {i} (page from "
                                        f"{int(want[i - i % page_size])})")


def host_tensor(t, target: bool = False) -> torch.Tensor:
    """A contiguous CPU tensor to do I/O on; a read target must be one already (a copy would be lost)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a host tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"expected a host (CPU) tensor, got one on {t.device}")
    if t.is_contiguous():
        return t
    if target:
        raise ValueError("read target tensor must be contiguous")
    return t.contiguous()
