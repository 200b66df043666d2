"""Partition leases on the device: one opener per partition, whatever path or host it comes from."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from radixtier.storage.nvmeof.layout import BLOCK, LEASE_CLEAN, LEASE_HELD, LeaseRecord
from radixtier.storage.nvmeof.lease import LeaseError
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace, read_superblock
from radixtier.storage.nvmeof.target import open_target, read_aligned, write_aligned

PAGE = 16 << 10


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE // 4,), i, dtype=torch.int32)


@pytest.fixture
def loop_over_file(tmp_path):
    """(backing file, loop device over it): two paths, two inodes, one namespace."""
    img = str(tmp_path / "ns.img")
    format_namespace(img, PAGE, capacity_bytes=16 << 20, partitions=2)
    try:
        dev = subprocess.run(["losetup", "--direct-io=on", "-f", "--show", img], check=True,
                             capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"loop devices are not permitted here (losetup: {getattr(exc, 'stderr', '') or exc})")
    try:
        yield img, dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def _open_in_child(path: str, partition: int = 0, extra: str = "") -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        from radixtier.storage.nvmeof.store import NvmeofPageStore
        try:
            s = NvmeofPageStore({path!r}, {PAGE}, partition={partition}, node_id="child"{extra})
        except RuntimeError as e:
            print(e); sys.exit(3)
        s.close()
        print("opened")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def _write_lease(path: str, partition: int, rec: LeaseRecord) -> None:
    sb = read_superblock(path)
    t = open_target(path, direct=False)
    try:
        write_aligned(t, sb.lease_offset(partition), rec.pack())
        os.fsync(t.fd)
    finally:
        t.close()


def _read_lease(path: str, partition: int) -> LeaseRecord:
    sb = read_superblock(path)
    t = open_target(path, direct=False, readonly=True)
    try:
        return LeaseRecord.unpack(read_aligned(t, sb.lease_offset(partition), BLOCK))
    finally:
        t.close()


def _other_host(state: int = LEASE_HELD, expires_in_s: float = 60.0) -> LeaseRecord:
    now = time.time_ns()
    return LeaseRecord(state, "node-far", "far-host", b"\x42" * 16, 1, 4242, 1, os.urandom(16), now, now,
                       now + int(expires_in_s * 1e9))


def test_loop_device_and_its_backing_file_are_one_partition(loop_over_file):
    img, dev = loop_over_file
    a = NvmeofPageStore(img, PAGE, node_id="via-file")
    with pytest.raises(RuntimeError, match="already open in this process"):
        NvmeofPageStore(dev, PAGE, node_id="via-loop")
    out = _open_in_child(dev)  # another process, through the other path
    assert out.returncode == 3 and "another process" in out.stdout, out.stdout + out.stderr
    assert "via-file" in out.stdout  # the error names the holder
    b = NvmeofPageStore(dev, PAGE, partition=1, node_id="via-loop")  # the other partition is free
    b.close()
    a.close()
    out = _open_in_child(dev)  # released cleanly: now it opens
    assert out.returncode == 0 and "opened" in out.stdout, out.stdout + out.stderr


def test_pages_survive_when_the_second_path_is_refused(loop_over_file):
    """The attack: both paths wrote partition 0 and half the acknowledged pages were lost."""
    img, dev = loop_over_file
    a = NvmeofPageStore(img, PAGE, node_id="via-file")
    assert all(a.put([key(i) for i in range(50)], [page(i) for i in range(50)]).ok)
    assert _open_in_child(dev).returncode == 3
    a.close()
    a = NvmeofPageStore(dev, PAGE, node_id="via-loop")
    out = [torch.zeros(PAGE // 4, dtype=torch.int32) for _ in range(50)]
    assert a.get([key(i) for i in range(50)], out) == [True] * 50
    assert all(torch.equal(out[i], page(i)) for i in range(50))
    a.close()


def test_another_hosts_silent_lease_is_watched_then_taken_or_forced(tmp_path):
    """Another host's record is taken only after it stayed unchanged for 1.25 x its lease + 2T (a
    live holder renews every L/4 and would have changed it), whatever its wall-clock expiry says;
    force_takeover takes it at once."""
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=8 << 20)
    rec = _other_host(expires_in_s=0.8)  # declares a 0.8 s lease, "valid" for 0.8 s more
    _write_lease(path, 0, rec)
    s = NvmeofPageStore(path, PAGE, force_takeover=True)
    assert s.recovery["unclean"] and s.recovery["lease_waited_s"] == 0  # its holder never closed
    s.close()
    _write_lease(path, 0, rec)
    s = NvmeofPageStore(path, PAGE, lease_s=0.4)
    assert s.recovery["unclean"] and s.recovery["lease_waited_s"] >= 1.25 * 0.8
    s.close()
    rec = _read_lease(path, 0)
    assert rec.state == LEASE_CLEAN and rec.node_id == "local"


def test_a_store_whose_lease_was_taken_stops_writing(tmp_path):
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, lease_s=0.4)
    assert all(s.put([key(i) for i in range(4)], [page(i) for i in range(4)]).ok)
    thief = _other_host(expires_in_s=60)
    _write_lease(path, 0, thief)  # another host took the partition (e.g. with force)
    deadline = time.monotonic() + 5
    while not s.fenced and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "node-far" in s.fenced
    table_before = _table_bytes(path)
    res = s.put([key(i) for i in range(10, 14)], [page(i) for i in range(10, 14)])
    assert res.ok == [False] * 4 and s.stats()["fenced_writes"] == 4
    s.delete([key(0)])  # removals stay in memory: the table on the device is the new holder's
    assert _table_bytes(path) == table_before
    out = torch.zeros(PAGE // 4, dtype=torch.int32)
    assert s.get([key(1)], [out]) == [True] and torch.equal(out, page(1))  # verified reads still work
    s.close()
    assert _read_lease(path, 0).token == thief.token  # close leaves the new holder's lease alone


def _table_bytes(path: str) -> bytes:
    sb = read_superblock(path)
    with open(path, "rb") as f:
        f.seek(sb.table_offset)
        return f.read(sb.data_offset - sb.table_offset)


def test_each_partition_lease_has_its_own_block(tmp_path):
    """Opening or closing one partition never rewrites another partition's lease."""
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20, partitions=3)
    sb = read_superblock(path)
    assert len({sb.lease_offset(p) // BLOCK for p in range(3)}) == 3 and sb.table_offset == 4 * BLOCK
    b = NvmeofPageStore(path, PAGE, partition=1, node_id="b")
    before = [_read_lease(path, p) for p in (0, 2)]
    a = NvmeofPageStore(path, PAGE, partition=0, node_id="a")
    a.close()
    c = NvmeofPageStore(path, PAGE, partition=2, node_id="c")
    assert _read_lease(path, 1).state == LEASE_HELD and _read_lease(path, 1).node_id == "b"
    c.close()
    b.close()
    assert before == [None, None]


CRASHER = """
import os, signal, sys
from radixtier.storage.nvmeof.store import NvmeofPageStore
try:
    s = NvmeofPageStore({path!r}, {page}, partition=int(sys.argv[1]), node_id="n" + sys.argv[1])
except RuntimeError:
    sys.exit(3)
os.kill(os.getpid(), signal.SIGKILL)  # dies holding the partition: its lease must say so
"""


def test_simultaneous_opens_of_two_partitions_keep_both_dirty_flags(tmp_path):
    """Version 1 read-modified-wrote one shared owner block: racing opens lost DIRTY flags."""
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20, partitions=2)
    code = CRASHER.format(path=path, page=PAGE)
    for _round in range(12):
        procs = [subprocess.Popen([sys.executable, "-c", code, str(p)]) for p in (0, 1, 0, 1)]
        codes = [p.wait(timeout=60) for p in procs]
        assert all(c in (-9, 3) for c in codes), codes  # opened and died, or refused (partition busy)
        for p in (0, 1):
            rec = _read_lease(path, p)
            assert rec is not None and rec.state == LEASE_HELD, f"partition {p} lost its DIRTY flag"
        for p in (0, 1):
            s = NvmeofPageStore(path, PAGE, partition=p, node_id=f"check{p}")
            assert s.recovery["unclean"], f"partition {p} looked clean after its holder was killed"
            s.close()


def test_a_stalled_renewal_stops_writes_before_the_lease_can_expire(tmp_path, monkeypatch):
    """A device path that stalls (or a paused process) must not keep writing past 3/4 of the lease:
    by expiry another host may own the partition."""
    from radixtier.storage.nvmeof import lease as lease_mod

    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=8 << 20, lease_s=0.4)
    gate = threading.Event()
    real_renew = lease_mod.PartitionLease.renew

    def stalled(self):
        gate.wait(10)  # the renewal's I/O hangs
        return real_renew(self)

    monkeypatch.setattr(lease_mod.PartitionLease, "renew", stalled)
    time.sleep(0.5)
    assert "not renewed" in s.fenced
    assert s.put([key(1)], [page(1)]).ok == [False]
    gate.set()  # the path comes back, nobody took the partition: writes resume
    deadline = time.monotonic() + 5
    while s.fenced and time.monotonic() < deadline:
        time.sleep(0.02)
    assert s.fenced == "" and s.put([key(1)], [page(1)]).ok == [True]
    s.close()


def test_a_failed_open_leaves_a_crashed_holders_state_for_the_next_open(tmp_path):
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=8 << 20)
    code = CRASHER.format(path=path, page=PAGE)
    assert subprocess.run([sys.executable, "-c", code, "0"], timeout=60).returncode == -9
    with pytest.raises(ValueError, match="io_engine"):
        NvmeofPageStore(path, PAGE, io_engine="no-such-engine")  # fails after taking the lease
    assert _read_lease(path, 0).state == LEASE_HELD  # not marked clean by the failed open
    s = NvmeofPageStore(path, PAGE)
    assert s.recovery["unclean"]  # so the crashed holder's slots are still re-checked
    s.close()
