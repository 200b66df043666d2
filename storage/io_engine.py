"""Parallel positional I/O for the page store: a thread pool of preadv/pwritev, or io_uring.

Both keep up to `queue_depth` I/Os in flight, which is what turns one NVMe-oF namespace's
bandwidth into usable bandwidth (a serial reader gets a fraction of it). io_uring comes from
the `liburing` package; its completion wait is done on an eventfd so the GIL is released
while the kernel works.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import mmap
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

log = logging.getLogger("radixtier.storage.io")

IOV_MAX = 1024
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

    def __init__(self, queue_depth: int = 16) -> None:
        if queue_depth <= 0:
            raise ValueError(f"queue_depth: expected a positive integer, got {queue_depth!r}")
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


_PROBE = """
import liburing as L
r = L.Ring()
rc = L.io_uring_queue_init(4, r, 0)
if rc not in (0, None):
    raise SystemExit(f"io_uring_queue_init: errno {-rc}")
L.io_uring_queue_exit(r)
"""
_probe_lock = threading.Lock()
_probe_result: Optional[str] = None  # None: not probed yet; "": usable; else why not


def uring_unusable_reason() -> Optional[str]:
    """Why io_uring cannot be used in this process, or None when it can.

    PyPI's liburing wheels are built for CPUs with AVX-512 and die with SIGILL elsewhere, a
    signal Python cannot catch; so the package is tried once in a child process before this
    process touches it, and a crash there becomes a logged fallback instead of a dead server.
    """
    global _probe_result
    with _probe_lock:
        if _probe_result is None and importlib.util.find_spec("liburing") is None:
            _probe_result = "the liburing package is not installed (pip install 'radixtier[uring]')"
        if _probe_result is None:
            try:
                out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as exc:
                _probe_result = f"the liburing probe could not run ({exc})"
            else:
                if out.returncode == 0:
                    _probe_result = ""
                elif out.returncode < 0:
                    name = signal.Signals(-out.returncode).name
                    _probe_result = (f"liburing crashed with {name} in a probe process (its wheel needs CPU "
                                     f"features this machine lacks, e.g. AVX-512)")
                else:
                    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
                    _probe_result = f"liburing is not usable here: {tail}"
        return _probe_result or None


class UringIO:
    """io_uring readv/writev, one ring per calling thread, up to `queue_depth` in flight per ring."""

    name = "io_uring"

    def __init__(self, queue_depth: int = 16) -> None:
        if queue_depth <= 0:
            raise ValueError(f"queue_depth: expected a positive integer, got {queue_depth!r}")
        reason = uring_unusable_reason()
        if reason:
            raise OSError(errno.ENOSYS, reason)  # tells make_engine to fall back
        self.queue_depth = queue_depth
        self._local = threading.local()
        self._rings: list = []
        self._lock = threading.Lock()
        self._ring()  # fail now, not on the first read, if the kernel refuses io_uring

    def _ring(self):
        import liburing as L

        st = getattr(self._local, "state", None)
        if st is None:
            ring, cqe = L.Ring(), L.Cqe()
            rc = L.io_uring_queue_init(self.queue_depth, ring, 0)
            if rc not in (0, None):
                raise OSError(-rc, f"io_uring_queue_init failed: {os.strerror(-rc)}")
            efd = os.eventfd(0, os.EFD_CLOEXEC)
            L.io_uring_register_eventfd(ring, efd)
            st = (ring, cqe, efd)
            self._local.state = st
            with self._lock:
                self._rings.append(st)
        return st

    def run(self, ops: Sequence[IOOp], on_done: Optional[OnDone] = None) -> List[int]:
        """Bytes moved (or -errno) per op; on_done(i, result) runs as each op completes, while the
        rest are still in flight (so callers can verify data under the remaining I/O)."""
        import liburing as L

        ring, cqe, efd = self._ring()
        self._local.batch = batch = (getattr(self._local, "batch", 0) + 1) & 0xFFFFFFFF
        results = [0] * len(ops)
        keep = {}  # iovecs must outlive their I/O
        state = {"next": 0, "inflight": 0}

        def top_up() -> None:
            while state["next"] < len(ops) and state["inflight"] < self.queue_depth:
                sqe = L.io_uring_get_sqe(ring)
                if sqe is None:
                    break
                i = state["next"]
                op = ops[i]
                iov = L.Iovec(list(op.bufs))
                keep[i] = iov
                (L.io_uring_prep_writev if op.write else L.io_uring_prep_readv)(sqe, op.fd, iov, op.offset)
                L.io_uring_sqe_set_data64(sqe, (batch << 32) | i)
                state["next"] += 1
                state["inflight"] += 1
            L.io_uring_submit(ring)

        try:
            top_up()
            while state["inflight"]:
                os.eventfd_read(efd)  # blocks without the GIL until at least one completion
                done = self._reap(ring, cqe, batch, results, keep)
                state["inflight"] -= len(done)
                top_up()  # refill the queue before spending time on the finished ones
                if on_done is not None:
                    for i in done:
                        if results[i] < 0 or results[i] >= ops[i].nbytes:  # short ones finish below
                            on_done(i, results[i])
        finally:
            while state["inflight"] > 0:  # never leave completions behind for the next call on this ring
                try:
                    os.eventfd_read(efd)
                    state["inflight"] -= len(self._reap(ring, cqe, batch, results, keep))
                except OSError:
                    break
        for i, op in enumerate(ops):  # finish short transfers synchronously (rare: EOF, signals)
            if 0 <= results[i] < op.nbytes:
                rest = IOOp(op.write, op.fd, op.offset + results[i], _advance(op.bufs, results[i]))
                more = _run_one(rest)
                results[i] = results[i] + more if more >= 0 else more
                if on_done is not None:
                    on_done(i, results[i])
        return results

    @staticmethod
    def _reap(ring, cqe, batch: int, results: List[int], keep: dict) -> List[int]:
        """Consume ready completions of this batch; returns their op indexes."""
        import liburing as L

        done: List[int] = []
        while True:
            try:
                if L.io_uring_peek_cqe(ring, cqe) != 0:
                    return done
            except BlockingIOError:  # no completion ready
                return done
            tag = L.io_uring_cqe_get_data64(cqe[0])
            res = cqe[0].res
            L.io_uring_cqe_seen(ring, cqe[0])
            if tag >> 32 != batch:
                continue  # a stale completion from an earlier, aborted call
            i = tag & 0xFFFFFFFF
            results[i] = res
            keep.pop(i, None)
            done.append(i)

    def close(self) -> None:
        import liburing as L

        with self._lock:
            for ring, _cqe, efd in self._rings:
                try:
                    L.io_uring_queue_exit(ring)
                finally:
                    os.close(efd)
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
