"""Parallel positional I/O for the page store: a thread pool of preadv/pwritev, or io_uring.

Both keep up to `queue_depth` I/Os in flight, which is what turns one NVMe-oF namespace's
bandwidth into usable bandwidth (a serial reader gets a fraction of it). io_uring is
radixtier's own small extension over the system liburing (radixtier/storage/nvmeof/_uring.c); where it was not
built, or the kernel refuses io_uring, `auto` uses the thread pool and logs why.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from radixtier.storage.api import PageSegments, native_buffer
from radixtier.storage.nvmeof.layout import NATIVE_LAYOUT
from radixtier.storage.nvmeof.status import PageStatus
from radixtier.validate import positive_int

log = logging.getLogger("radixtier.storage.io")

IOV_MAX = 1024
MAX_QUEUE_DEPTH = 4096  # I/Os in flight per ring or pool (the extension accepts 1..4096)
OnDone = Callable[[int, int], None]  # (op index, bytes moved or -errno)
Region = Tuple[int, int]  # (address, nbytes) of host memory
FIXED_REGION_MAX = 1 << 30  # the kernel registers fixed buffers of at most 1 GiB each


def fixed_chunks(regions: Sequence[Region]) -> List[Region]:
    """Host memory regions cut into pieces io_uring can register (each at most 1 GiB)."""
    out: List[Region] = []
    for i, (addr, nbytes) in enumerate(regions):
        if isinstance(addr, bool) or not isinstance(addr, int) or addr <= 0:
            raise ValueError(f"regions[{i}]: address must be a positive int, got {addr!r}")
        positive_int(f"regions[{i}] nbytes", nbytes)
        for at in range(0, nbytes, FIXED_REGION_MAX):
            out.append((addr + at, min(FIXED_REGION_MAX, nbytes - at)))
    return out


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


def deadline_clock() -> float:
    """The clock write deadlines are stated in (seconds): CLOCK_BOOTTIME, monotonic and counting
    through a suspend (CLOCK_MONOTONIC stops there: a resumed holder would think its lease young)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def deadline_ns(deadline: Optional[float]) -> int:
    """A deadline_clock() deadline as the native code takes it (nanoseconds; 0: none)."""
    return 0 if deadline is None else max(1, int(deadline * 1e9))


def _load_native_pwritev():
    try:
        from radixtier.storage.nvmeof import _fence
    except ImportError:
        return None
    return _fence.pwritev_by


_native_pwritev = _load_native_pwritev()


def deadline_check_reason() -> Optional[str]:
    """Why write deadlines are checked in Python here (a pause can fall between the check and the
    write), or None when the check runs in C right before each write."""
    if _native_pwritev is None:
        return ("radixtier's _fence extension is not built (a C compiler at install time builds it): write "
                "deadlines of the partition lease are checked in Python, which a long pause can outlast")
    return None


def pwritev_by(fd: int, bufs: Sequence[memoryview], offset: int, deadline: Optional[float]) -> int:
    """pwritev, issued only before `deadline` (deadline_clock(); None: always): OSError(ETIME) after.

    With the _fence extension the check and the system call run in C with nothing in between (a
    garbage-collector pause cannot fall there); without it see deadline_check_reason()."""
    if deadline is None:
        return os.pwritev(fd, bufs, offset)
    if _native_pwritev is not None:
        return _native_pwritev(fd, bufs, offset, deadline_ns(deadline))
    if deadline_clock() >= deadline:
        raise OSError(errno.ETIME, "write deadline passed (partition lease not renewed in time)")
    return os.pwritev(fd, bufs, offset)


def _run_one(op: IOOp, deadline: Optional[float] = None) -> int:
    """Run an op to completion (short transfers are continued); returns bytes or -errno. A write
    is issued only before `deadline` (deadline_clock()), each continuation checked again."""
    done, total = 0, op.nbytes
    bufs = list(op.bufs)
    try:
        while done < total:
            if op.write:
                n = pwritev_by(op.fd, bufs, op.offset + done, deadline)
            else:
                n = os.preadv(op.fd, bufs, op.offset + done)
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

    def run(self, ops: Sequence[IOOp], on_done: Optional[OnDone] = None,
            deadline: Optional[float] = None) -> List[int]:
        """Bytes moved (or -errno) per op; on_done(i, result) runs as each op finishes, in a worker.
        Writes are issued only before `deadline` (deadline_clock()); later ones give -ETIME."""
        def one(i: int) -> int:
            r = _run_one(ops[i], deadline)
            if on_done is not None:
                on_done(i, r)
            return r

        if len(ops) <= 1:
            return [one(i) for i in range(len(ops))]
        return list(self._pool.map(one, range(len(ops))))

    def register_memory(self, regions: Sequence[Region]) -> bool:
        """Nothing to register for preadv/pwritev (kept so callers need not know the engine)."""
        fixed_chunks(regions)
        return False

    def fixed_ios(self) -> int:
        return 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_uring_reason: Optional[str] = None  # None: not checked yet; "": usable; else why not
_uring_lock = threading.Lock()


def uring_unusable_reason() -> Optional[str]:
    """Why the io_uring engine cannot be used in this process, or None when it can.

    The engine is radixtier's own extension (radixtier/storage/nvmeof/_uring.c over the system liburing, built by
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
                mismatch = native_mismatch(_uring)
                if mismatch:
                    _uring_reason = (f"radixtier's io_uring extension was built from other sources ({mismatch}); "
                                     f"rebuild it (bash scripts/setup.sh)")
                    return _uring_reason
                try:
                    _uring.Ring(2).close()
                    _uring_reason = ""
                except OSError as exc:
                    _uring_reason = f"the kernel refused an io_uring instance: {exc.strerror or exc}"
        return _uring_reason or None


def native_mismatch(module) -> str:
    """'' when the native core's format constants and status codes are Python's; else what differs.
    One definition each (layout.py, status.py), checked against the C build at load, not in a test."""
    want = {"LAYOUT": NATIVE_LAYOUT, "STATUS": {s.name: s.value for s in PageStatus}}
    for name, values in want.items():
        have = vars(module).get(name)  # None from a build older than these dicts
        if have != values:
            diff = sorted(k for k in set(values) | set(have or {}) if (have or {}).get(k) != values.get(k))
            return f"{name} differs in {', '.join(diff)}"
    return ""


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
        self._rings: list = []  # (ring, the thread it belongs to)
        self._lock = threading.Lock()
        self._closed = False
        self._fixed: List[Region] = []  # host memory every reading ring registers as fixed buffers
        self._registry = None  # a Ring holding that registration (pinned once), which readers clone
        self._fixed_version = 0  # bumped by register_memory; a ring registers when it lags
        self._fixed_refused: Optional[str] = None  # why the kernel refused, once: then never retried
        self._clone_ok = True  # False once the kernel refused to clone (then each ring pins itself)
        self._retired_fixed_ios = 0  # fixed_ios of rings closed with their finished threads
        self._ring()  # fail now, not on the first read, if the kernel refuses io_uring

    def _ring(self, reads_fixed: bool = False):
        """This thread's ring; reads_fixed: one that reads pages, so it takes the registered host
        memory first (writes and plain runs never use fixed buffers, so their threads hold none)."""
        from radixtier.storage.nvmeof import _uring

        if self._closed:
            raise RuntimeError("io_uring engine is closed")
        ring = getattr(self._local, "ring", None)
        if ring is None or ring.closed:  # torn down after a failed submission: start a new one
            ring = _uring.Ring(self.queue_depth)
            self._local.ring = ring
            self._local.fixed_version = 0
            with self._lock:
                self._close_finished_rings()  # short-lived threads (an announcement per flush) leave theirs
                self._rings.append((ring, threading.current_thread()))
        if reads_fixed and self._local.fixed_version != self._fixed_version:
            self._register_on(ring)
        return ring

    def _register_on(self, ring) -> None:
        """Give this thread's ring the registered host memory: a clone of the registry ring's set
        (Linux 6.12+: the pages stay pinned once, for every thread), or where the kernel cannot
        clone, its own registration (~30 ms per GiB of 4 KiB pages, once per reading thread). A
        refusal is logged once, every ring drops its set (all or none), and reads go on as plain
        vectored I/O: the same bytes, only without the saving."""
        with self._lock:  # cloned under the lock: register_memory swaps and closes the registry under it
            version, registry, chunks = self._fixed_version, self._registry, list(self._fixed)
            self._local.fixed_version = version
            if registry is not None and self._clone_ok:
                try:
                    ring.clone_buffers(registry)
                    return
                except OSError as exc:
                    self._clone_ok = False
                    log.info("radixtier: io_uring cannot clone registered buffers here (%s; Linux < 6.12?): "
                             "each reading thread pins the host memory itself", exc.strerror or exc)
        if registry is None:  # nothing registered (any more): drop this ring's set (unpinning: not under the lock)
            ring.register([])
            return
        try:
            ring.register(chunks)
        except OSError as exc:
            ring.register([])
            self._refused(exc, chunks)

    def _refused(self, exc: OSError, chunks: List[Region]) -> None:
        """The kernel refused a registration: from now on nothing is registered on any ring (each
        drops its set before its next read) and no registration is tried again."""
        with self._lock:
            first = self._fixed_refused is None
            self._fixed_refused = exc.strerror or str(exc)
            self._set_registry(None, [])
        if first:
            hint = " (raise RLIMIT_MEMLOCK to allow it)" if exc.errno == errno.ENOMEM else ""
            log.warning("radixtier: io_uring refused to register %d MiB of host memory as fixed buffers "
                        "(%s); reads use plain vectored I/O%s", sum(n for _a, n in chunks) >> 20,
                        exc.strerror or exc, hint)

    def _set_registry(self, registry, chunks: List[Region]) -> None:
        """Under self._lock: the new set, and the rings of finished threads closed."""
        old, self._registry = self._registry, registry
        self._fixed = chunks
        self._fixed_version += 1
        if old is not None:
            old.close()  # rings that cloned it hold their own references to its pages
        self._close_finished_rings()

    def _close_finished_rings(self) -> None:
        """Under self._lock: close the rings of threads that ended (a ring lives in its thread's
        threading.local, so nothing else would close it, nor drop its pins, before close())."""
        live = []
        for ring, owner in self._rings:
            if owner.is_alive():
                live.append((ring, owner))
            else:
                self._retired_fixed_ios += ring.fixed_ios
                ring.close()
        self._rings = live

    def register_memory(self, regions: Sequence[Region]) -> bool:
        """Register host memory (SGLang's host pool) as io_uring fixed buffers: the kernel pins it
        once (in a registry ring the engine keeps), each thread's ring takes the set before its next
        read, and large page segments inside it are then read with READ_FIXED (no per-I/O pinning of
        their 4 KiB pages). Replaces any earlier set; [] drops it (rings of finished threads are
        closed now, live ones drop it before their next read). The memory must stay mapped until
        then. Pinning costs ~30 ms per GiB of 4 KiB-page memory (6 ms on huge pages), paid here.
        Returns False when nothing is registered: the kernel refused (now or before: not retried;
        see the log), the engine is closed, or regions was empty."""
        from radixtier.storage.nvmeof import _uring

        chunks = fixed_chunks(regions)
        with self._lock:
            if self._closed:
                return False
            drop = not chunks or self._fixed_refused is not None
            if drop:
                self._set_registry(None, [])
        if drop:
            self._ring(reads_fixed=True)  # the calling thread's ring lets go now too
            return False
        registry = _uring.Ring(1)
        try:
            registry.register(chunks)  # the pinning, outside the lock
        except OSError as exc:
            registry.close()
            self._refused(exc, chunks)
            return False
        with self._lock:
            if self._closed:
                registry.close()
                return False
            self._set_registry(registry, chunks)
        self._ring(reads_fixed=True)  # the calling thread's ring takes the set now
        return True

    def fixed_ios(self) -> int:
        """I/Os issued on registered buffers by this engine's live rings (for stats and tests)."""
        with self._lock:
            return self._retired_fixed_ios + sum(r.fixed_ios for r, _owner in self._rings)

    def run(self, ops: Sequence[IOOp], on_done: Optional[OnDone] = None,
            deadline: Optional[float] = None) -> List[int]:
        """Bytes moved (or -errno) per op; on_done(i, result) runs as each op completes, while the
        rest are still in flight (so callers can verify data under the remaining I/O). Nothing is
        submitted past `deadline` (deadline_clock(); checked in C before each submission): the call
        then raises OSError(ETIME) once what was submitted has landed."""
        ring = self._ring()
        short: List[int] = []

        def landed(i: int, r: int) -> None:
            if 0 <= r < ops[i].nbytes:
                short.append(i)  # finished below
            elif on_done is not None:
                on_done(i, r)

        results = ring.run([(op.write, op.fd, op.offset, op.bufs) for op in ops], landed, deadline_ns(deadline))
        for i in short:  # finish short transfers synchronously (rare: EOF, signals)
            op = ops[i]
            rest = IOOp(op.write, op.fd, op.offset + results[i], _advance(op.bufs, results[i]))
            more = _run_one(rest, deadline) if rest.bufs else 0
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
        return self._ring(reads_fixed=True).read_pages(batch, fd, data_offset, slot_bytes, uuid, keys, slots,
                                                       indexes, coalesce_bytes, direct)

    def write_pages(self, batch, fd: int, data_offset: int, slot_bytes: int, uuid: bytes, plan: list,
                    coalesce_bytes: int, direct: bool, deadline: Optional[float] = None):
        """(status bytes, checksums, packed table entries, first errno): plan items (batch index, key,
        parent, slot, generation). Nothing is issued past `deadline` (deadline_clock(); errno ETIME)."""
        return self._ring().write_pages(batch, fd, data_offset, slot_bytes, uuid, plan, coalesce_bytes, direct,
                                        deadline_ns(deadline))

    def close(self) -> None:
        """Close every thread's ring; the store calls this only once no call is running."""
        with self._lock:
            self._closed = True
            for ring, _owner in self._rings:
                ring.close()
            self._rings.clear()
            if self._registry is not None:
                self._registry.close()
                self._registry = None


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
