"""Host memory that KV pages land in: zeroed, on a 2 MiB boundary, on transparent huge pages.

Why huge pages: a tier-3 read ends in the kernel copying (or a device writing) each page into this
memory, and with 4 KiB pages that copy walks a TLB entry per 4 KiB. Measured on a RAM-backed loop
device, verified 1 MiB reads into a 256 MiB destination ran at 7.6 GB/s on 4 KiB pages and 8.9 GB/s
on huge pages (fio, reading into a few cache-hot buffers, 8.0). The kernel decides: with THP set to
`never` (or no huge page free) the memory is plain 4 KiB pages and everything still works.

The memory is an anonymous mapping of its own (not the allocator's heap, whose reused pages are
already faulted in as 4 KiB pages), advised before its first touch and faulted in here, so no
page fault lands inside a timed or serving read. It is zero because it is fresh, and it is freed
when the last tensor viewing it goes.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it


def host_memory(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory as a uint8 tensor, faulted in. Starts on a 2 MiB boundary
    (a base-page boundary below 2 MiB), so O_DIRECT can read into any 4 KiB-aligned part of it."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: expected a positive integer, got {nbytes!r}")
    huge = nbytes >= HUGE_PAGE_BYTES
    # private: a shared anonymous mapping is shmem, which THP's `enabled` setting does not cover
    mapping = mmap.mmap(-1, nbytes + (HUGE_PAGE_BYTES if huge else 0), flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    skip = (-whole.data_ptr()) % HUGE_PAGE_BYTES if huge else 0
    if huge:
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
        except OSError:  # a kernel without THP: 4 KiB pages, as any allocation
            pass
    _fault_in(mapping, skip, nbytes)  # with the advice above, as whole huge pages
    return whole[skip:skip + nbytes]


def _fault_in(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault the range in, writable, by the kernel (MADV_POPULATE_WRITE, Linux 5.14+), else by
    writing zeros over it (a fresh mapping is zero already). Not with a torch op: torch's
    parallel fill hangs in a process forked after the parent used its thread pool, and serving
    and bench processes are forked."""
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, start, length)
        return
    except OSError:  # an older kernel: EINVAL
        pass
    zeros = bytes(min(length, HUGE_PAGE_BYTES))
    for at in range(start, start + length, len(zeros)):
        n = min(len(zeros), start + length - at)
        mapping[at:at + n] = zeros[:n]
