"""Partition ownership that lives on the device: one lease block per partition.

Two openers of one partition each believe their table; the later one's writes silently
destroy the earlier one's pages. A lock held in one kernel cannot see a loop device and its
backing file (two inodes), nor a second host attached to the same NVMe-oF namespace, so the
owner is recorded where every opener can read it: the partition's lease block.

Protocol (all lease I/O is one 4 KiB block, O_DIRECT where the target takes it, fdatasync'd):

1. Take a host lock (flock on a lock file named by namespace uuid and partition): openers on
   this host are serialised and a live one is refused at once, whatever path it opened.
2. Read the lease block. A live holder is refused with an error naming it (node, host, pid,
   expiry). A holder is dead when it is on this host and boot (same boot id and pid namespace)
   and its process is gone, or when its lease expired (wall clock; hosts must keep clocks in
   sync to well under `lease_s`); `force` takes over a live lease from another host.
3. Write our record (a fresh random token), fdatasync, wait `settle_s`, read it back: another
   host that wrote in between wins and we are refused (the settle time exceeds any opener's
   read-to-write gap by orders of magnitude).
4. A renewal thread rewrites the expiry every `lease_s / 4`, first reading the block: a token
   that is not ours means another opener took the partition, and the lease is marked lost (the
   store then stops writing: fenced). A lease that could not be renewed for `lease_s` is lost too.
5. A clean close writes state CLEAN: the next opener skips the slot-header re-check.

Lock order: the lease's own `_lock` is a leaf (no other lock is taken while holding it).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from typing import Optional, Set

from radixtier.storage.nvmeof.layout import LEASE_CLEAN, LEASE_HELD, LeaseRecord, Superblock
from radixtier.storage.nvmeof.target import Target, read_aligned, write_aligned

log = logging.getLogger("radixtier.storage.nvmeof.lease")

DEFAULT_LEASE_S = 15.0
DEFAULT_SETTLE_S = 0.1
_HOST_LOCK_GRACE_S = 0.5  # a process killed with -9 releases its flock as it exits; allow a moment
_HELD_TOKENS: Set[bytes] = set()  # tokens of leases held by this process
_HELD_LOCK = threading.Lock()


class LeaseError(RuntimeError):
    """The partition is held by another opener (the message names it)."""


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16]
    except (OSError, ValueError):
        return b""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_start(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live process, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) "
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _lock_dir() -> str:
    for d in (os.environ.get("RADIXTIER_LOCK_DIR"), "/run/lock", "/tmp"):
        if d and os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return "."


def describe(rec: LeaseRecord) -> str:
    """'node X on host H (pid P)' for error messages."""
    return f"node {rec.node_id!r} on host {rec.host!r} (pid {rec.pid})"


class PartitionLease:
    """The lease on one partition of one namespace, held from acquire() to release()."""

    def __init__(self, target: Target, sb: Superblock, partition: int, node_id: str, *,
                 lease_s: float = DEFAULT_LEASE_S, settle_s: float = DEFAULT_SETTLE_S,
                 force: bool = False) -> None:
        self._t = target
        self._offset = sb.lease_offset(partition)
        self._where = f"partition {partition} of {target.path}"
        self._lock_path = os.path.join(_lock_dir(), f"radixtier-{sb.uuid}-p{partition}.lock")
        self.node_id = node_id
        self.lease_s = lease_s
        self.settle_s = settle_s
        self.force = force
        self.previous: Optional[LeaseRecord] = None  # what the block held before we took it
        self.unclean = False  # the previous holder did not close cleanly (or the block was damaged)
        self._lock = threading.Lock()
        self._lost = ""
        self._valid_until = 0.0  # monotonic: past this, with no renewal since, another host may own it
        self._record: Optional[LeaseRecord] = None
        self._host_fd = -1
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- public API
    def acquire(self) -> None:
        """Take the partition or raise LeaseError naming the holder; starts renewal."""
        self._take_host_lock()
        try:
            raw = read_aligned(self._t, self._offset, 4096)
            prev = LeaseRecord.unpack(raw)
            self.previous = prev
            self.unclean = (prev is None and any(raw)) or (prev is not None and prev.state == LEASE_HELD)
            if prev is not None and prev.state == LEASE_HELD:
                self._check_takeover(prev)
            mine = self._new_record()
            write_aligned(self._t, self._offset, mine.pack())
            os.fdatasync(self._t.fd)
            if self.settle_s > 0:
                time.sleep(self.settle_s)
            now = LeaseRecord.unpack(read_aligned(self._t, self._offset, 4096))
            if now is None or now.token != mine.token:
                who = describe(now) if now is not None else "an opener whose record is damaged"
                raise LeaseError(f"{self._where}: another opener took it while this one did ({who}); "
                                 f"give each node its own partition")
        except BaseException:
            self._drop_host_lock()
            raise
        self._record = mine
        self._valid_until = time.monotonic() + self._trusted_s()
        with _HELD_LOCK:
            _HELD_TOKENS.add(mine.token)
        self._thread = threading.Thread(target=self._renew_loop, name="radixtier-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> str:
        """Why the lease may no longer be ours ('' while it is): the store does not write while set.

        Set for good when another opener's token was read back; also, for as long as it lasts,
        when no renewal succeeded for 3/4 of the lease (a stalled path or a paused process): by
        expiry another host may take the partition, so writing stops before that can happen."""
        with self._lock:
            if self._lost:
                return self._lost
        if self._record is not None and time.monotonic() > self._valid_until:
            return (f"{self._where}: lease not renewed for {self._trusted_s():.1f} s (device stalled or process "
                    f"paused); writes wait until a renewal succeeds")
        return ""

    def _trusted_s(self) -> float:
        return self.lease_s * 0.75

    def renew(self) -> bool:
        """Re-read and extend the lease now; False (and `lost` set) when it is no longer ours."""
        with self._lock:
            if self._lost or self._record is None:  # taken for good (a stale renewal may resume, below)
                return False
        try:
            cur = LeaseRecord.unpack(read_aligned(self._t, self._offset, 4096))
        except OSError as exc:
            return self._renew_failed(f"lease read failed: {exc}")
        if cur is None or cur.token != self._record.token:
            who = describe(cur) if cur is not None else "a damaged lease record"
            self._mark_lost(f"{self._where} was taken over by {who}; this store stopped writing to it")
            return False
        now = time.time_ns()
        rec = LeaseRecord(LEASE_HELD, cur.node_id, cur.host, cur.boot_id, cur.pid_ns, cur.pid, cur.pid_start,
                          cur.token, cur.acquired_ns, now, now + int(self.lease_s * 1e9))
        try:
            write_aligned(self._t, self._offset, rec.pack())
            os.fdatasync(self._t.fd)
        except OSError as exc:
            return self._renew_failed(f"lease write failed: {exc}")
        self._record = rec
        self._valid_until = time.monotonic() + self._trusted_s()
        return True

    def release(self, mode: str = "clean") -> None:
        """Stop renewing, then, if the lease is still ours:
        "clean"   (a clean close) mark the partition CLEAN: the next open skips the slot re-check;
        "restore" (an open that failed) put back what the open found: a crashed predecessor's
                  HELD record (so its slots are still re-checked), else CLEAN;
        "keep"    (a close with I/O still running) leave our HELD record: nobody may take the
                  partition as clean, and a restart here re-checks its slots."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # renewal stuck in I/O: writing now could race it
                mode = "keep"
        rec = self._record
        try:
            if rec is not None and not self._lost and mode != "keep":
                cur = LeaseRecord.unpack(read_aligned(self._t, self._offset, 4096))
                if cur is not None and cur.token == rec.token:
                    prev = self.previous
                    if mode == "restore" and prev is not None and prev.state == LEASE_HELD:
                        done = prev
                    else:
                        done = LeaseRecord(LEASE_CLEAN, rec.node_id, rec.host, rec.boot_id, rec.pid_ns, rec.pid,
                                           rec.pid_start, rec.token, rec.acquired_ns, time.time_ns(), 0)
                    write_aligned(self._t, self._offset, done.pack())
                    os.fdatasync(self._t.fd)
        finally:
            if rec is not None:
                with _HELD_LOCK:
                    _HELD_TOKENS.discard(rec.token)
            self._record = None
            self._drop_host_lock()

    # ---------------------------------------------------------------- internals
    def _new_record(self) -> LeaseRecord:
        now = time.time_ns()
        pid = os.getpid()
        return LeaseRecord(LEASE_HELD, self.node_id, socket.gethostname(), _boot_id(), _pid_ns(), pid,
                           _pid_start(pid) or 0, os.urandom(16), now, now, now + int(self.lease_s * 1e9))

    def _check_takeover(self, prev: LeaseRecord) -> None:
        """Raise LeaseError unless the holder recorded in `prev` is gone (or force says take it)."""
        with _HELD_LOCK:
            mine = prev.token in _HELD_TOKENS
        if mine:
            raise LeaseError(f"{self._where} is already open in this process (through another path to the "
                             f"same namespace)")
        same_machine = prev.boot_id == _boot_id() and prev.pid_ns == _pid_ns() and prev.boot_id != b""
        if same_machine:
            start = _pid_start(prev.pid)
            if start is not None and start == prev.pid_start:
                raise LeaseError(f"{self._where} is open in another process: {describe(prev)}; give each node "
                                 f"its own partition")
            log.warning("radixtier: %s: previous holder %s is gone; taking over", self._where, describe(prev))
            return
        left_s = (prev.expires_ns - time.time_ns()) / 1e9
        if left_s <= 0:
            log.warning("radixtier: %s: lease of %s expired %.1f s ago; taking over", self._where,
                        describe(prev), -left_s)
            return
        if self.force:
            log.warning("radixtier: %s: taking over the live lease of %s (force)", self._where, describe(prev))
            return
        raise LeaseError(f"{self._where} is held by {describe(prev)} for another {left_s:.1f} s (its lease "
                         f"is renewed while it runs); give each node its own partition, or take it over "
                         f"with force_takeover once that node is stopped")

    def _take_host_lock(self) -> None:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + _HOST_LOCK_GRACE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    here = holder.startswith(f"pid {os.getpid()} ")
                    where = "in this process" if here else "in another process on this host"
                    raise LeaseError(f"{self._where} is already open {where} ({holder}); give each node "
                                     f"its own partition") from None
                time.sleep(0.02)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} node {self.node_id} path {self._t.path}\n".encode(), 0)
        self._host_fd = fd

    def _drop_host_lock(self) -> None:
        if self._host_fd >= 0:
            os.close(self._host_fd)  # closing the only descriptor releases the flock
            self._host_fd = -1

    def _renew_loop(self) -> None:
        period = max(0.05, self.lease_s / 4)
        while not self._stop.wait(period):
            if not self.renew():
                with self._lock:
                    if self._lost:
                        return

    def _renew_failed(self, why: str) -> bool:
        rec = self._record
        if rec is not None and time.time_ns() >= rec.expires_ns:
            self._mark_lost(f"{self._where}: lease not renewed before it expired ({why}); this store "
                            f"stopped writing to it")
        else:
            log.warning("radixtier: %s: %s; retrying", self._where, why)
        return False

    def _mark_lost(self, why: str) -> None:
        with self._lock:
            first = not self._lost
            self._lost = why
        if first:
            log.error("radixtier: %s", why)
