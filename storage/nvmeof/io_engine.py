"""Parallel positional I/O for the page store: a thread pool of preadv/pwritev, or io_uring.

Both keep up to `queue_depth` I/Os in flight, which is what turns one NVMe-oF namespace's
bandwidth into usable bandwidth (a serial reader gets a fraction of it). io_uring is
radixtier's own small extension over the system liburing (storage/nvmeof/_uring.c); where it was not
built, or the kernel refuses io_uring, `auto` uses the thread pool and logs why.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from radixtier.storage.api import PageSegments, native_buffer
from radixtier.storage.validate import positive_int

log = logging.getLogger("radixtier.storage.io")

IOV_MAX = 1024
MAX_QUEUE_DEPTH = 4096  # I/Os in flight per ring or pool (the extension accepts 1..4096)
OnDone = Callable[[int, int], None]  # (op index, bytes moved or -errno)


@dataclass
class IOOp:
    """One vectored I/O: `bufs` laid end to end starting at `offset`."""

    write: bool
    fd: int
    offset: int
    bufs: List[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.bufs)


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory (what O_DIRECT needs), as a writable byte view."""
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


def _run_one(op: IOOp) -> int:
    """Run an op to completion (short transfers are continued); returns bytes or -errno."""
    done, total = 0, op.nbytes
    bufs = list(op.bufs)
    try:
        while done < total:
            n = (os.pwritev if op.write else os.preadv)(op.fd, bufs, op.offset + done)
            if n <= 0:
                return -errno.EIO if op.write else done
            done += n
            if done < total:
                bufs = _advance(op.bufs, done)
        return done
    except OSError as exc:
        return -(exc.errno or errno.EIO)


def _advance(bufs: Sequence[memoryview], skip: int) -> List[memoryview]:
    out: List[memoryview] = []
    for b in bufs:
        if skip >= b.nbytes:
            skip -= b.nbytes
            continue
        out.append(b[skip:])
        skip = 0
    return out


class ThreadPoolIO:
    """preadv/pwritev on a pool of `queue_depth` threads (each call releases the GIL)."""

    name = "threads"
    native_pages = False  # the store runs its Python page path (per-page verify callbacks) over run()

    def __init__(self, queue_depth: int = 16) -> None:
        positive_int("queue_depth", queue_depth, MAX_QUEUE_DEPTH)
        self.queue_depth = queue_depth
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="radixtier-pio")

    def run(self, ops: Sequence[IOOp], on_done: Optional[OnDone] = None) -> List[int]:
        """Bytes moved (or -errno) per op; on_done(i, result) runs as each op finishes, in a worker."""
        def one(i: int) -> int:
            r = _run_one(ops[i])
            if on_done is not None:
                on_done(i, r)
            return r

        if len(ops) <= 1:
            return [one(i) for i in range(len(ops))]
        return list(self._pool.map(one, range(len(ops))))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_uring_reason: Optional[str] = None  # None: not checked yet; "": usable; else why not
_uring_lock = threading.Lock()


def uring_unusable_reason() -> Optional[str]:
    """Why the io_uring engine cannot be used in this process, or None when it can.

    The engine is radixtier's own extension (storage/nvmeof/_uring.c over the system liburing, built by
    the normal install): it is compiled for this machine, so unlike PyPI's `liburing` wheels
    (AVX-512 only, and leaking a buffer export per I/O) it cannot die with SIGILL. What remains
    is whether it was built (liburing-dev present at install) and whether the kernel or a
    sandbox's seccomp policy lets this process create a ring.
    """
    global _uring_reason
    with _uring_lock:
        if _uring_reason is None:
            try:
                from radixtier.storage.nvmeof import _uring
            except ImportError as exc:
                _uring_reason = (f"radixtier's io_uring extension is not built ({exc}); install liburing-dev "
                                 f"and reinstall radixtier (bash scripts/setup.sh)")
            else:
                try:
                    _uring.Ring(2).close()
                    _uring_reason = ""
                except OSError as exc:
                    _uring_reason = f"the kernel refused an io_uring instance: {exc.strerror or exc}"
        return _uring_reason or None


class UringIO:
    """io_uring readv/writev, one ring per calling thread, up to `queue_depth` in flight per ring.

    Submission, the completion wait (GIL released) and reaping run in C; Python runs only the
    caller's per-completion callback (e.g. CRC verification, overlapped with the I/O still in
    flight). Each caller buffer is exported exactly while the kernel may use it.
    """

    name = "io_uring"
    native_pages = True  # whole page batches run in C: page_batch(), read_pages(), write_pages()

    def __init__(self, queue_depth: int = 16) -> None:
        positive_int("queue_depth", queue_depth, MAX_QUEUE_DEPTH)
        reason = uring_unusable_reason()
        if reason:
            raise OSError(errno.ENOSYS, reason)  # tells make_engine to fall back
        self.queue_depth = queue_depth
        self._local = threading.local()
        self._rings: list = []
        self._lock = threading.Lock()
        self._closed = False
        self._ring()  # fail now, not on the first read, if the kernel refuses io_uring

    def _ring(self):
        from radixtier.storage.nvmeof import _uring

        if self._closed:
            raise RuntimeError("io_uring engine is closed")
        ring = getattr(self._local, "ring", None)
        if ring is None or ring.closed:  # torn down after a failed submission: start a new one
            ring = _uring.Ring(self.queue_depth)
            self._local.ring = ring
            with self._lock:
                self._rings.append(ring)
        return ring

    def run(self, ops: Sequence[IOOp], on_done: Optional[OnDone] = None) -> List[int]:
        """Bytes moved (or -errno) per op; on_done(i, result) runs as each op completes, while the
        rest are still in flight (so callers can verify data under the remaining I/O)."""
        ring = self._ring()
        short: List[int] = []

        def landed(i: int, r: int) -> None:
            if 0 <= r < ops[i].nbytes:
                short.append(i)  # finished below
            elif on_done is not None:
                on_done(i, r)

        results = ring.run([(op.write, op.fd, op.offset, op.bufs) for op in ops], landed)
        for i in short:  # finish short transfers synchronously (rare: EOF, signals)
            op = ops[i]
            rest = IOOp(op.write, op.fd, op.offset + results[i], _advance(op.bufs, results[i]))
            more = _run_one(rest) if rest.bufs else 0
            results[i] = results[i] + more if more >= 0 else more
            if on_done is not None:
                on_done(i, results[i])
        return results

    def page_batch(self, buffers: Sequence[object], writable: bool):
        """Export page buffers once for read_pages/write_pages (ValueError names a bad buffer).
        Tensors travel as (address, nbytes) after a device/contiguity check."""
        from radixtier.storage.nvmeof import _uring

        if isinstance(buffers, PageSegments):  # flat segment lists: taken in one step
            return _uring.PageBatch(buffers.addresses, writable, sizes=buffers.sizes, per_page=buffers.per_page)
        return _uring.PageBatch([native_buffer(b) for b in buffers], writable)

    def read_pages(self, batch, fd: int, data_offset: int, slot_bytes: int, uuid: bytes, keys: list, slots: list,
                   indexes: Optional[list], coalesce_bytes: int, direct: bool):
        """(status bytes, first errno): page i is keys[i] at slots[i] into batch page indexes[i] (or i
        when indexes is None); see _pagebatch.c."""
        return self._ring().read_pages(batch, fd, data_offset, slot_bytes, uuid, keys, slots, indexes,
                                       coalesce_bytes, direct)

    def write_pages(self, batch, fd: int, data_offset: int, slot_bytes: int, uuid: bytes, plan: list,
                    coalesce_bytes: int, direct: bool):
        """(status bytes, checksums, packed table entries, first errno): plan items (batch index, key,
        parent, slot, generation)."""
        return self._ring().write_pages(batch, fd, data_offset, slot_bytes, uuid, plan, coalesce_bytes, direct)

    def close(self) -> None:
        """Close every thread's ring; the store calls this only once no call is running."""
        with self._lock:
            self._closed = True
            for ring in self._rings:
                ring.close()
            self._rings.clear()


ENGINES = ("auto", "threads", "io_uring")


def make_engine(kind: str = "auto", queue_depth: int = 16):
    """io_uring where the package and kernel allow it ('auto'), else the thread pool (reason logged)."""
    if kind not in ENGINES:
        raise ValueError(f"io_engine: expected one of {', '.join(ENGINES)}, got {kind!r}")
    if kind in ("auto", "io_uring"):
        try:
            return UringIO(queue_depth)
        except Exception as exc:  # ImportError, or the kernel/sandbox refusing io_uring
            if kind == "io_uring":
                raise ValueError(f"io_engine: 'io_uring' requested but unavailable: {exc}") from exc
            log.info("radixtier: io_uring unavailable (%s); using the preadv/pwritev thread pool", exc)
    return ThreadPoolIO(queue_depth)
