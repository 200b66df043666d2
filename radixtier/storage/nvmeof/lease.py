"""Partition ownership that lives on the device: one lease block per partition (a delta lease).

Two openers of one partition each believe their table; the later one's writes silently destroy
the earlier one's pages. A lock held in one kernel cannot see a loop device and its backing file
(two inodes), nor a second host attached to the same NVMe-oF namespace, so the owner is recorded
where every opener can read it: the partition's lease block. The algorithm is sanlock's delta
lease, whose safety rests on bounded I/O time and clock *rates*, never on a short sleep or on
hosts agreeing about the time of day.

Timing contract (every opener of a namespace uses the same values):
  L = lease_s               how long a renewal keeps the partition (default 15 s, 8T..3600 s)
  T = lease_io_timeout_s    bound on any write reaching the device, counted from the moment it
                            passes its deadline check (default 1 s; RADIXTIER_LEASE_IO_TIMEOUT_S
                            sets the default): the fabric's I/O timeout and any stall of this
                            process between the check and the system call must fit in it
  clock rates within 10% of each other (CLOCK_BOOTTIME; absolute values never compared); a paused
  virtual machine stops that clock too, so a VM pause longer than T breaks the contract
  direct I/O (the default): with `direct=False` reads may come from this host's page cache and
  writes reach the device at writeback, so a namespace shared by hosts must keep O_DIRECT

Protocol (all lease I/O is one 4 KiB block, O_DIRECT where the target takes it, fdatasync'd):

1. Read the block. Never written or CLEAN: go to 3. Damaged (fails its CRC when read again): watched
   as below. HELD by this process (a token it holds): refused. HELD on this machine (same boot id and
   pid namespace) by a live process: refused at once; by a dead one, or by this process's own
   failed open: go to 3. HELD elsewhere: *watched* for 1.25 x its lease + 2T of our own clock,
   re-reading: any change (a renewal) means the holder is alive and we are refused (naming the
   clock difference when its wall-clock expiry looked past), no change means the holder stopped
   writing (2 below) and we go on. `force` skips the wait. Wall clocks are only used in messages.
2. A holder issues a write -- data, table or lease -- only before its deadline: the time (on
   CLOCK_BOOTTIME, which keeps counting through a suspend) it issued its last successful renewal
   + L - T. The check runs in C right before each submission (_uring.c rt_past, _fence.c), so its
   last write lands by renewal + L, before any watcher can finish watching. A holder past its deadline is lapsed: it writes nothing until
   it has re-acquired (3) its own unchanged record.
3. Write our record (fresh token), issued at most T after the read that justified it (else read
   again), fdatasync, wait 2.5T, read back: any opener that wrote in between -- its write landed
   within 2T of our read -- is seen, and only the last writer keeps the partition.
4. A renewal thread, L/4 after each renewal was issued, reads the block (another token: taken
   over, lost for good, and logged with how long our lease still had) and rewrites it with a new
   expiry (the same T bound from read to write), extending the deadline.
5. A clean close writes state CLEAN (under the same deadline): the next opener skips the
   slot-header re-check and needs no wait.

No lock file is used: a path-based lock in a shared folder is a local attack surface (symlinks,
a foreign flock holding the service off) and sees neither a loop device's backing file nor
another host; the protocol above serialises every opener on its own.

Lock order: the lease's own `_lock` is a leaf (no other lock is taken while holding it).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from typing import Dict, Optional, Set, Tuple

from radixtier.storage.nvmeof.io_engine import deadline_clock as clock
from radixtier.storage.nvmeof.io_engine import pwritev_by
from radixtier.storage.nvmeof.layout import BLOCK, LEASE_CLEAN, LEASE_HELD, LeaseRecord, Superblock
from radixtier.storage.nvmeof.target import Target, read_aligned
from radixtier.validate import positive_seconds

log = logging.getLogger("radixtier.storage.nvmeof.lease")

DEFAULT_LEASE_S = 15.0
MAX_LEASE_S = 3600.0
LEASE_TO_IO = 8  # lease_s must be at least this many lease I/O bounds (renewals every L/4, deadline L - T)
IO_TIMEOUT_ENV = "RADIXTIER_LEASE_IO_TIMEOUT_S"
MIN_IO_TIMEOUT_S, MAX_IO_TIMEOUT_S = 0.001, 60.0
_WATCH_FACTOR = 1.25  # a watcher waits this many of the holder's leases (covers clock rates 10% apart)
_SETTLE_IOS = 2.5  # after writing, wait this many I/O bounds before reading back
_GAP_RETRIES = 8  # reads retried when the read-to-write gap exceeded the I/O bound
_HELD_TOKENS: Set[bytes] = set()  # tokens of leases held by this process
_KEPT: Dict[bytes, float] = {}  # token -> write deadline of a lease closed with I/O still running ("keep")
_HELD_LOCK = threading.Lock()  # guards _HELD_TOKENS and _KEPT


class LeaseError(RuntimeError):
    """The partition is held by another opener (the message names it)."""


def default_io_timeout_s() -> float:
    """The lease I/O bound when none is given: $RADIXTIER_LEASE_IO_TIMEOUT_S, else 1 s."""
    raw = os.environ.get(IO_TIMEOUT_ENV)
    if raw is None:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{IO_TIMEOUT_ENV}: expected a number of seconds, got {raw[:40]!r}") from None
    return positive_seconds(IO_TIMEOUT_ENV, value, MIN_IO_TIMEOUT_S, MAX_IO_TIMEOUT_S)


def check_timing(lease_s: object, io_timeout_s: object) -> Tuple[float, float]:
    """(lease_s, lease_io_timeout_s) validated together: a lease must outlast 8 I/O bounds."""
    io = positive_seconds("lease_io_timeout_s", io_timeout_s, MIN_IO_TIMEOUT_S, MAX_IO_TIMEOUT_S)
    lease = positive_seconds("lease_s", lease_s, LEASE_TO_IO * io, MAX_LEASE_S)
    return lease, io


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


def _holder_alive(pid: int, pid_start: int) -> bool:
    """Whether the process a lease record names (this machine, this pid namespace) still runs.
    Where /proc hides it (hidepid) the kernel still answers kill(pid, 0): only ESRCH means gone."""
    start = _pid_start(pid)
    if start is not None:
        return start == pid_start
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: alive, another user's
    return True  # there, though /proc hides it: alive (a reused pid errs on the side of refusing)


def remove_legacy_lock_files(uuid: str) -> int:
    """Remove the host lock files radixtier 0.x left in /run/lock (never removed there, and never
    needed now): only regular files this user owns, never following a link. Returns how many."""
    removed = 0
    for folder in dict.fromkeys(d for d in (os.environ.get("RADIXTIER_LOCK_DIR"), "/run/lock", "/tmp") if d):
        try:
            names = [n for n in os.listdir(folder) if n.startswith(f"radixtier-{uuid}-p") and n.endswith(".lock")]
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(path)
                    removed += 1
            except OSError:
                continue
    return removed


def describe(rec: LeaseRecord) -> str:
    """'node X on host H (pid P)' for error messages (repr: control characters are escaped)."""
    return f"node {rec.node_id!r} on host {rec.host!r} (pid {rec.pid})"


def read_block(t: Target, offset: int) -> bytes:
    """One lease block (module-level so fault-injection tests can slow it)."""
    return read_aligned(t, offset, BLOCK)


def write_block(t: Target, offset: int, data: bytes, deadline: float) -> None:
    """One lease block, issued only before `deadline` (io_engine.deadline_clock()), then fdatasync'd."""
    import mmap

    buf = mmap.mmap(-1, BLOCK)
    try:
        buf[:len(data)] = data
        n = pwritev_by(t.fd, [buf], offset, deadline)
        if n != BLOCK:
            raise OSError(errno.EIO, f"{t.path}: short lease write at offset {offset} ({n} of {BLOCK} bytes)")
    finally:
        buf.close()
    os.fdatasync(t.fd)


class PartitionLease:
    """The lease on one partition of one namespace, held from acquire() to release().

    Fields and their owners: `_record`, `_written`, `_attempted`, `_issued` and `_deadline` are
    written by acquire() (before the renewal thread starts), then only by the renewal thread, and
    by release() after that thread stopped; store threads only read `_deadline` (one float). `_lost`
    is written under `_lock` (a leaf lock)."""

    def __init__(self, target: Target, sb: Superblock, partition: int, node_id: str, *,
                 lease_s: float = DEFAULT_LEASE_S, io_timeout_s: Optional[float] = None,
                 force: bool = False) -> None:
        self._t = target
        self._offset = sb.lease_offset(partition)
        self._where = f"partition {partition} of {target.path}"
        self._uuid = sb.uuid
        self.node_id = node_id
        self.lease_s, self.io_timeout_s = check_timing(
            lease_s, default_io_timeout_s() if io_timeout_s is None else io_timeout_s)
        self.force = force
        self.previous: Optional[LeaseRecord] = None  # what the block held before we took it
        self.unclean = False  # the previous holder did not close cleanly (or the block was damaged)
        self.waited_s = 0.0  # how long acquire() watched another host's record
        self._lock = threading.Lock()
        self._lost = ""  # set for good once another opener's token was read, or at release()
        self._deadline = 0.0  # lease clock: no write may be issued from then on (renewal + L - T)
        self._issued = 0.0  # lease clock: when the write of our current record was issued
        self._record: Optional[LeaseRecord] = None
        self._written = b""  # the block as we last wrote it (and read it back)
        self._attempted = b""  # the block as we last tried to write it (it may have landed)
        self._tokens: Set[bytes] = set()  # tokens this opener wrote (the winner's stays held)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- public API
    def acquire(self) -> None:
        """Take the partition or raise LeaseError naming the holder; starts renewal."""
        remove_legacy_lock_files(self._uuid)
        found, read_at = self._read_at()
        prev = LeaseRecord.unpack(found)
        self.previous = prev
        self.unclean = (prev is None and any(found)) or (prev is not None and prev.state == LEASE_HELD)
        self._last_found = found
        try:
            self._take(found, read_at)
        except BaseException:
            self._put_back()
            raise
        with _HELD_LOCK:  # only the winning token stays this process's
            _HELD_TOKENS.difference_update(self._tokens - {self._record.token})
        self._thread = threading.Thread(target=self._renew_loop, name="radixtier-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> str:
        """Why the lease may no longer be ours ('' while it is): the store does not write while set.

        Set for good when another opener's token was read back, or once released; also, for as
        long as it lasts, once the write deadline passed without a renewal (a stalled path or a
        paused process): writing stops before another host could take the partition, and resumes
        once this holder re-acquired its own unchanged record."""
        with self._lock:
            if self._lost:
                return self._lost
        if self._record is not None and clock() >= self._deadline:
            return (f"{self._where}: lease not renewed within {self.lease_s - self.io_timeout_s:.1f} s (device "
                    f"stalled or process paused); writes wait until a renewal succeeds")
        return ""

    def write_deadline(self) -> float:
        """The deadline_clock() time before which a write may be issued; OSError when none may be now."""
        why = self.lost
        if why:
            raise OSError(errno.ETIME, why)
        return self._deadline

    def renew(self) -> bool:
        """Re-read and extend the lease now; False when it is not extended (`lost` says why)."""
        with self._lock:
            if self._lost or self._record is None or self._stop.is_set():
                return False
        rec = self._record
        try:
            cur_raw, read_at = self._read_at()
            cur = LeaseRecord.unpack(cur_raw)
            if cur is None:  # a torn or damaged read: look again before concluding anything
                time.sleep(self.io_timeout_s / 4)
                cur_raw, read_at = self._read_at()
                cur = LeaseRecord.unpack(cur_raw)
        except OSError as exc:
            log.warning("radixtier: %s: lease read failed: %s; retrying", self._where, exc)
            return False
        if cur is None or cur.token != rec.token:
            self._taken_over(cur)
            return False
        if cur_raw not in (self._written, self._attempted):  # our token, other bytes: not our writing
            self._mark_lost(f"{self._where}: its lease block changed under this holder (same token, other "
                            f"content); this store stopped writing to it")
            return False
        lapsed = clock() >= self._deadline
        now = time.time_ns()
        new = LeaseRecord(LEASE_HELD, rec.node_id, rec.host, rec.boot_id, rec.pid_ns, rec.pid, rec.pid_start,
                          rec.token, rec.acquired_ns, now, now + int(self.lease_s * 1e9))
        limit = read_at + self.io_timeout_s
        if not lapsed:
            limit = min(limit, self._deadline)
        issued = clock()
        self._attempted = new.pack()
        try:
            write_block(self._t, self._offset, self._attempted, limit)
        except OSError as exc:  # ETIME: the read took longer than T (a loaded host); retried soon
            (log.debug if exc.errno == errno.ETIME else log.warning)(
                "radixtier: %s: lease renewal not written (%s); retrying", self._where, exc.strerror or exc)
            return False
        if lapsed:  # re-acquiring our own record: another opener may have written since our read
            time.sleep(_SETTLE_IOS * self.io_timeout_s)
            try:
                back = LeaseRecord.unpack(read_block(self._t, self._offset))
            except OSError as exc:
                log.warning("radixtier: %s: lease read failed: %s; retrying", self._where, exc)
                return False
            if back is None or back.token != rec.token:
                self._taken_over(back)
                return False
        with self._lock:
            if self._lost or self._stop.is_set():  # released meanwhile: extend nothing
                return False
            self._written = self._attempted
            self._record = new
            self._issued = issued
            self._deadline = issued + self.lease_s - self.io_timeout_s
        return True

    def release(self, mode: str = "clean") -> None:
        """Stop renewing and writing, then, if the lease is still ours and a write may be issued:
        "clean"   (a clean close) mark the partition CLEAN: the next open skips the slot re-check;
        "restore" (an open that failed) put back what the open found: a crashed predecessor's
                  HELD record (so its slots are still re-checked), else CLEAN;
        "keep"    (a close with I/O still running) leave our HELD record: nobody may take the
                  partition as clean, and a reopen in this process waits until writes still
                  running here can no longer be issued."""
        deadline = self._deadline
        with self._lock:  # no write may start from now on (a running call's own checks see this)
            was_lost = self._lost
            self._lost = self._lost or f"{self._where}: lease released"
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.io_timeout_s + 1))
            if self._thread.is_alive():  # renewal stuck in I/O: writing now could race it
                mode = "keep"
        rec = self._record
        try:
            if rec is not None and mode == "keep" and not was_lost:
                with _HELD_LOCK:
                    _KEPT[rec.token] = max(deadline, self._deadline)
            elif rec is not None and not was_lost:
                prev = self.previous
                if mode == "restore" and prev is not None and prev.state == LEASE_HELD:
                    done = prev
                else:
                    done = LeaseRecord(LEASE_CLEAN, rec.node_id, rec.host, rec.boot_id, rec.pid_ns, rec.pid,
                                       rec.pid_start, rec.token, rec.acquired_ns, time.time_ns(), 0)
                if not self._rewrite_own(rec.token, done.pack(), deadline):
                    log.warning("radixtier: %s: lease left marked open (its deadline passed); the next opener "
                                "re-checks its slots", self._where)
        except OSError as exc:  # the device failed: the record stays HELD
            log.warning("radixtier: %s: lease left marked open (%s); the next opener re-checks its slots",
                        self._where, exc.strerror or exc)
        finally:
            if rec is not None:
                with _HELD_LOCK:
                    _HELD_TOKENS.discard(rec.token)
            self._record = None
            self._deadline = 0.0

    # ---------------------------------------------------------------- acquisition
    def _read_at(self) -> Tuple[bytes, float]:
        """(block, lease-clock time the read was issued)."""
        at = clock()
        return read_block(self._t, self._offset), at

    def _take(self, found: bytes, read_at: float) -> None:
        """Steps 1 and 3 of the protocol: decide, write our record, wait, verify."""
        watched = None  # a block watched to the end unchanged: its holder stopped writing
        for _attempt in range(_GAP_RETRIES):
            prev = LeaseRecord.unpack(found)
            if prev is None and any(found) and found != watched:  # torn by a concurrent write? look again
                sound = self._reread_damaged()
                if sound is not None:
                    found, read_at = sound
                    continue
            self._last_found = found
            if found != watched and self._must_watch(found, prev):
                found, read_at = self._watch(found, prev)
                watched = found
                continue
            mine = self._new_record()
            issued = clock()
            self._attempted = mine.pack()
            try:
                write_block(self._t, self._offset, self._attempted, read_at + self.io_timeout_s)
            except OSError as exc:
                if exc.errno != errno.ETIME:
                    raise
                found, read_at = self._read_at()  # the gap from read to write grew past T: again
                continue
            time.sleep(_SETTLE_IOS * self.io_timeout_s)
            back_raw = read_block(self._t, self._offset)
            back = LeaseRecord.unpack(back_raw)
            if back is None or back.token != mine.token:
                who = describe(back) if back is not None else "an opener whose record is damaged"
                raise LeaseError(f"{self._where}: another opener took it while this one did ({who}); "
                                 f"give each node its own partition")
            self._record = mine
            self._written = back_raw
            self._issued = issued
            self._deadline = issued + self.lease_s - self.io_timeout_s
            return
        raise LeaseError(f"{self._where}: lease I/O took longer than lease_io_timeout_s="
                         f"{self.io_timeout_s:g} s {_GAP_RETRIES} times in a row; raise lease_io_timeout_s "
                         f"(and lease_s) on every node, or check the device path")

    def _reread_damaged(self) -> Optional[Tuple[bytes, float]]:
        """A block that failed its CRC, read again a few times: a read torn by a concurrent write
        (buffered targets) comes back sound; (block, read time) then, else None (damaged for good)."""
        for _ in range(3):
            time.sleep(self.io_timeout_s / 4)
            raw, at = self._read_at()
            if LeaseRecord.unpack(raw) is not None or not any(raw):
                return raw, at
        return None

    def _must_watch(self, found: bytes, prev: Optional[LeaseRecord]) -> bool:
        """Raise LeaseError for a live holder; True when the block must be watched before taking
        it, False when it may be taken at once (free, clean, a dead process here, or force)."""
        if prev is None:  # never written (all zero), or damaged for good (see _take): watched unless force
            return any(found) and not self.force
        if prev.state != LEASE_HELD:
            return False
        with _HELD_LOCK:
            mine = prev.token in _HELD_TOKENS
            kept = _KEPT.pop(prev.token, None)
        if mine:
            raise LeaseError(f"{self._where} is already open in this process (through another path to the "
                             f"same namespace)")
        same_machine = prev.boot_id == _boot_id() and prev.pid_ns == _pid_ns() and prev.boot_id != b""
        if same_machine:
            if prev.pid == os.getpid():  # this process's own: a failed open, or a close with I/O running
                if kept is not None:  # writes still running there may be issued until that deadline
                    time.sleep(max(0.0, kept + self.io_timeout_s - clock()))
                log.warning("radixtier: %s: taking back this process's earlier record", self._where)
                return False
            if _holder_alive(prev.pid, prev.pid_start):
                raise LeaseError(f"{self._where} is open in another process: {describe(prev)}; give each node "
                                 f"its own partition")
            log.warning("radixtier: %s: previous holder %s is gone; taking over", self._where, describe(prev))
            return False
        if self.force:
            log.warning("radixtier: %s: taking over the lease of %s (force)", self._where, describe(prev))
            return False
        return True

    def _watch(self, found: bytes, prev: Optional[LeaseRecord]) -> Tuple[bytes, float]:
        """Watch another host's record (or a damaged block) for 1.25 x its lease + 2T of our own
        clock: unchanged, it is ours to take (returns the last read and when it was issued);
        changed, its holder is alive (LeaseError), or it was released (returned: taken at once)."""
        declared = (prev.expires_ns - prev.renewed_ns) / 1e9 if prev is not None else 0.0
        holder_s = max(self.lease_s, declared if 0 < declared <= MAX_LEASE_S else 0.0)
        window = _WATCH_FACTOR * holder_s + 2 * self.io_timeout_s
        left_s = (prev.expires_ns - time.time_ns()) / 1e9 if prev is not None else 0.0
        what = f"the lease of {describe(prev)}" if prev is not None else "a damaged lease block"
        log.warning("radixtier: %s: watching %s for %.1f s before taking over (it %s by this host's clock)",
                    self._where, what, window, f"expires in {left_s:.1f} s" if left_s > 0 else
                    f"expired {-left_s:.1f} s ago")
        start = clock()
        end = start + window
        step = max(self.io_timeout_s, min(1.0, window / 8))
        while True:
            time.sleep(max(0.0, min(step, end - clock())))
            raw, at = self._read_at()
            if raw != found:
                self._changed_while_watched(raw, prev, left_s)
                self.waited_s = at - start
                return raw, at  # released (CLEAN): taken without further watching
            if at >= end:
                self.waited_s = at - start
                return raw, at

    def _changed_while_watched(self, raw: bytes, prev: Optional[LeaseRecord], left_s: float) -> None:
        cur = LeaseRecord.unpack(raw)
        if cur is not None and cur.state == LEASE_CLEAN:
            return
        if cur is not None and prev is not None and cur.token == prev.token:
            clocks = (f"; its lease looked {-left_s:.1f} s expired by this host's clock, so the two hosts' "
                      f"clocks differ by about that much: keep them in sync, e.g. NTP" if left_s < 0 else "")
            raise LeaseError(f"{self._where} is held by {describe(cur)}: it renewed its lease while this "
                             f"opener watched{clocks}; give each node its own partition, or take it over with "
                             f"force_takeover once that node is stopped")
        who = describe(cur) if cur is not None else "an opener whose record is damaged"
        raise LeaseError(f"{self._where}: another opener took it while this one watched ({who}); give each "
                         f"node its own partition")

    def _rewrite_own(self, token: bytes, data: bytes, limit: float) -> bool:
        """Replace our own record (token) with `data`, each try issued at most T after the read that
        found our token and before `limit`; False when the block is not ours or no try fitted."""
        for _attempt in range(_GAP_RETRIES):
            raw, at = self._read_at()
            cur = LeaseRecord.unpack(raw)
            if cur is None or cur.token != token:
                return False
            if at >= limit:
                return False
            try:
                write_block(self._t, self._offset, data, min(at + self.io_timeout_s, limit))
                return True
            except OSError as exc:
                if exc.errno != errno.ETIME:
                    raise
        return False

    def _put_back(self) -> None:
        """A failed acquire: if one of our records landed (even when its write reported an error),
        put back what the block last held, so neither this process nor another is refused by it."""
        try:
            raw, at = self._read_at()
            cur = LeaseRecord.unpack(raw)
            if cur is not None and cur.token in self._tokens:
                self._rewrite_own(cur.token, self._last_found, at + self.lease_s - self.io_timeout_s)
        except OSError as exc:
            log.warning("radixtier: %s: could not put the lease block back after a failed open (%s); the "
                        "next opener in this process takes it over, others after watching it", self._where,
                        exc.strerror or exc)
        finally:
            self._record = None
            with _HELD_LOCK:
                _HELD_TOKENS.difference_update(self._tokens)

    # ---------------------------------------------------------------- internals
    def _new_record(self) -> LeaseRecord:
        """A fresh HELD record; its token counts as this process's from before it is written, so a
        concurrent open in this process is refused and a failed open can tell its own leftovers."""
        now = time.time_ns()
        pid = os.getpid()
        token = os.urandom(16)
        self._tokens.add(token)
        with _HELD_LOCK:
            _HELD_TOKENS.add(token)
        return LeaseRecord(LEASE_HELD, self.node_id, socket.gethostname(), _boot_id(), _pid_ns(), pid,
                           _pid_start(pid) or 0, token, now, now, now + int(self.lease_s * 1e9))

    def _renew_loop(self) -> None:
        """Renew L/4 after the last renewal was issued; after a failed try, again soon (every L/32,
        at least T): a slow read or write must not use up the few tries a deadline of L - T leaves."""
        period = self.lease_s / 4
        wait = max(0.0, self._issued + period - clock())
        while not self._stop.wait(wait):
            if self.renew():
                wait = max(0.0, self._issued + period - clock())
                continue
            with self._lock:
                if self._lost:
                    return
            wait = max(self.io_timeout_s, period / 8)

    def _taken_over(self, cur: Optional[LeaseRecord]) -> None:
        """Another opener's record is in our block: lost for good; say how much lease we had left
        (time left > 0 means its taker did not wait for us: force_takeover, or a broken contract)."""
        left = self._deadline + self.io_timeout_s - clock()
        who = describe(cur) if cur is not None else "a damaged lease record"
        hint = (f" while this holder's lease had {left:.1f} s left (force_takeover, or the timing contract "
                f"broken)" if left > 0 else "")
        self._mark_lost(f"{self._where} was taken over by {who}{hint}; this store stopped writing to it")

    def _mark_lost(self, why: str) -> None:
        with self._lock:
            first = not self._lost
            self._lost = why
        if first:
            log.error("radixtier: %s", why)
