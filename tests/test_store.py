"""NvmeofPageStore on a plain file and on a loop device (O_DIRECT): integrity, recovery, eviction, sharing."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from radixtier.cli import main as cli_main
from radixtier.storage.nvmeof.io_engine import uring_unusable_reason
from radixtier.storage.nvmeof.layout import BLOCK, HEADER_BYTES, FormatError
from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace
from radixtier.storage.api import buffer_address

from radixtier.testing.pages import page_content

PAGE = 16 << 10  # bytes
NUMEL = PAGE // 4
SIXTY_FOUR_SLOTS = 3 * 4096 + 80 * (4096 + PAGE + 64)  # bytes that format into exactly 64 slots


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def content(i: int) -> torch.Tensor:
    return page_content(key(i), NUMEL)


@pytest.fixture(params=["file", "loop"])
def target(request, tmp_path):
    """A namespace path: a plain file, or a loop block device with direct I/O."""
    img = str(tmp_path / "ns.img")
    if request.param == "file":
        yield img
        return
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    try:
        dev = subprocess.run(["losetup", "--direct-io=on", "-f", "--show", img], check=True,
                             capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        msg = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"loop devices are not permitted here (losetup: {msg.strip()})")
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def _o_direct_works(folder) -> bool:
    """Whether this filesystem takes O_DIRECT (tmpfs does not): then the store must use it."""
    if folder is None:
        return True
    probe = os.path.join(folder, ".odirect-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def open_store(path, **kw):
    if path.startswith("/dev/"):
        if kw.pop("fresh", True):
            format_namespace(path, PAGE, force=True)
        return NvmeofPageStore(path, PAGE, **kw)
    kw.pop("fresh", None)
    return NvmeofPageStore(path, PAGE, create_bytes=kw.pop("create_bytes", 16 << 20), **kw)


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_round_trip_direct_and_bounced(target, engine):
    if engine == "io_uring" and uring_unusable_reason():
        pytest.skip(f"io_uring engine unavailable: {uring_unusable_reason()}")
    s = open_store(target, io_engine=engine)
    n = 24
    pages = [content(i) for i in range(n)]
    res = s.put([key(i) for i in range(n)], pages, [None] + [key(i) for i in range(n - 1)])
    assert all(res.ok) and not res.evicted
    # aligned destination (direct into the buffer) and unaligned (through a bounce buffer)
    raw = torch.zeros(n * NUMEL + 1024 + 1, dtype=torch.int32)
    aligned_at = ((-raw.data_ptr()) % BLOCK) // 4
    aligned = [raw[aligned_at + i * NUMEL: aligned_at + (i + 1) * NUMEL] for i in range(n)]
    assert buffer_address(aligned[0])[0] % BLOCK == 0
    assert s.get([key(i) for i in range(n)], aligned) == [True] * n
    unaligned = [torch.zeros(NUMEL + 1, dtype=torch.int32)[1:] for _ in range(n)]
    assert s.get([key(i) for i in range(n)], unaligned) == [True] * n
    for i in range(n):
        assert torch.equal(aligned[i], pages[i]) and torch.equal(unaligned[i], pages[i])
    if _o_direct_works(os.path.dirname(target) if not target.startswith("/dev/") else None):
        assert s.direct  # files on such a filesystem and loop devices with --direct-io take O_DIRECT
    s.close()


def test_scatter_gather_segments_round_trip(tmp_path):
    s = open_store(str(tmp_path / "ns.img"))
    k = torch.arange(NUMEL // 2, dtype=torch.int32)
    v = -torch.arange(NUMEL // 2, dtype=torch.int32)
    assert s.put([key(1)], [[k, v]]).ok == [True]  # one page given as two segments (K and V)
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    assert s.get([key(1)], [[k2, v2]]) == [True]
    assert torch.equal(k, k2) and torch.equal(v, v2)
    s.close()


def test_adjacent_slots_are_coalesced(tmp_path):
    s = open_store(str(tmp_path / "ns.img"), io_engine="threads")
    s.put([key(i) for i in range(8)], [content(i) for i in range(8)])
    calls = []
    real = s._engine.run

    def spy(ops, on_done=None, deadline=None):
        calls.append(len(ops))
        return real(ops, on_done, deadline)

    s._engine.run = spy
    assert all(s.get([key(i) for i in range(8)], [torch.zeros(NUMEL, dtype=torch.int32) for _ in range(8)]))
    assert calls == [1]  # eight adjacent slots, one vectored read
    s.close()


def _slot_payload_offset(s: NvmeofPageStore, k: bytes) -> int:
    return s.sb.slot_offset(s.location(k).slot) + HEADER_BYTES


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
@pytest.mark.parametrize("where", ["payload", "header", "table_stale"])
def test_corrupt_torn_or_stale_page_is_a_miss_and_freed(tmp_path, where, engine):
    _skip_without(engine)
    path = str(tmp_path / "ns.img")
    s = open_store(path, io_engine=engine)
    s.put([key(i) for i in range(4)], [content(i) for i in range(4)])
    victim = key(2)
    loc = s.location(victim)
    with open(path, "r+b") as f:
        if where == "payload":
            f.seek(_slot_payload_offset(s, victim) + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))  # one flipped bit
        elif where == "header":
            f.seek(s.sb.slot_offset(loc.slot) + 8)
            f.write(b"\xff\xff\xff\xff")  # torn header
        else:  # the slot now holds another page's bytes (a stale table entry)
            f.seek(s.sb.slot_offset(s.location(key(3)).slot))
            data = f.read(s.sb.slot_bytes)
            f.seek(s.sb.slot_offset(loc.slot))
            f.write(data)
    out = [torch.zeros(NUMEL, dtype=torch.int32) for _ in range(4)]
    assert s.get([key(i) for i in range(4)], out) == [True, True, False, True]
    assert s.counters.corrupt == 1
    kind = {"payload": "corrupt_checksum", "header": "corrupt_header", "table_stale": "corrupt_header"}[where]
    assert getattr(s.counters, kind) == 1
    assert s.exists([victim]) == [False]  # freed: never read again
    assert s.take_dropped() == [victim] and s.take_dropped() == []  # named once, for the index and the tree
    assert torch.equal(out[3], content(3))
    s.close()
    report = inspect_json(path)
    assert report["used"] == 3 and report["errors"] == []  # the bad page was dropped from the table


def inspect_json(path, verify=True):
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        cli_main(["inspect", path, "--json"] + (["--verify"] if verify else []))
    return json.loads(buf.getvalue())


def test_inspect_reports_corruption(tmp_path):
    path = str(tmp_path / "ns.img")
    s = open_store(path)
    s.put([key(i) for i in range(3)], [content(i) for i in range(3)])
    off = _slot_payload_offset(s, key(1))
    s.close()
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"garbage!")
    rep = inspect_json(path)
    assert rep["used"] == 3
    assert [e["key"] for e in rep["errors"]] == [key(1).hex()]
    assert rep["errors"][0]["error"] == "payload checksum mismatch"


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_read_location_checks_generation(tmp_path, engine):
    _skip_without(engine)
    s = open_store(str(tmp_path / "ns.img"), io_engine=engine)
    s.put([key(1)], [content(1)])
    loc = s.location(key(1))
    buf = torch.zeros(NUMEL, dtype=torch.int32)
    assert s.read_location(loc, key(1), buf) and torch.equal(buf, content(1))
    from dataclasses import replace

    assert not s.read_location(replace(loc, generation=loc.generation + 1), key(1), buf)  # stale
    assert not s.read_location(loc, key(2), buf)  # wrong page
    assert s.counters.corrupt_stale == 2 and s.counters.corrupt_header == 0  # counted by kind
    assert not s.read_location(replace(loc, namespace="0" * 32), key(1), buf)  # other namespace
    s.close()


def test_read_location_with_a_record_of_the_wrong_size_is_a_miss(tmp_path):
    s = open_store(str(tmp_path / "ns.img"))
    s.put([key(1)], [content(1)])
    small = torch.zeros(NUMEL // 2, dtype=torch.int32)
    assert s.read_location(s.location(key(1)), key(1), small) is False  # never an exception into serving
    s.close()


def test_bad_input_leaks_no_slot_and_pins_no_page(tmp_path):
    s = open_store(str(tmp_path / "ns.img"))
    free = s.num_free
    with pytest.raises(ValueError, match="key: expected 16 bytes"):
        s.put([key(1), key(2)], [content(1), content(2)], [None, b"short"])
    assert s.num_free == free and len(s) == 0
    s.put([key(1), key(2)], [content(1), content(2)])
    with pytest.raises(ValueError, match="buffer for page"):
        s.get([key(1), key(2)], [torch.zeros(NUMEL, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)])
    assert s.delete([key(1), key(2)]) == 2  # neither page was left pinned as being read
    s.close()


def _skip_without(engine: str) -> None:
    if engine == "io_uring" and uring_unusable_reason():
        pytest.skip(f"io_uring engine unavailable: {uring_unusable_reason()}")


def _fail_writes(s: NvmeofPageStore, monkeypatch) -> None:
    """Every data write of `s` fails (EIO), on whichever page path its engine runs."""
    if s._engine.native_pages:
        monkeypatch.setattr(s._engine, "write_pages", lambda batch, fd, d, sb, u, plan, c, direct, deadline=None:
                            (b"\x01" * len(plan), [0] * len(plan), bytes(64 * len(plan)), 5))
    else:
        monkeypatch.setattr(s._io, "_run_coalesced",
                            lambda write, ops, on_done=None, deadline=None: ([False] * len(ops), 5))


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_duplicate_key_in_a_batch_is_stored_only_if_its_write_is(tmp_path, monkeypatch, engine):
    _skip_without(engine)
    s = open_store(str(tmp_path / "ns.img"), io_engine=engine)
    _fail_writes(s, monkeypatch)
    res = s.put([key(1), key(1)], [content(1), content(1)])
    assert res.ok == [False, False]
    assert (res.written, res.already_stored) == (0, 0)
    monkeypatch.undo()
    res = s.put([key(1), key(1)], [content(1), content(1)])
    assert res.ok == [True, True] and (res.written, res.already_stored) == (1, 0)
    res = s.put([key(1), key(2), key(2)], [content(1), content(2), content(2)])
    assert res.ok == [True] * 3 and (res.written, res.already_stored) == (1, 1)  # what SGLang's backup figures count
    s.close()


def test_a_failed_write_returns_its_slots(tmp_path, monkeypatch):
    s = open_store(str(tmp_path / "ns.img"))
    free = s.num_free

    def broken_sync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("radixtier.storage.nvmeof.store.os.fdatasync", broken_sync)
    with pytest.raises(OSError):
        s.put([key(i) for i in range(3)], [content(i) for i in range(3)])
    monkeypatch.undo()
    assert s.num_free == free and s.exists([key(0)]) == [False]
    s.close()


def test_restart_recovers_index(target):
    s = open_store(target)
    s.put([key(i) for i in range(10)], [content(i) for i in range(10)], [None] + [key(i) for i in range(9)])
    s.close()
    s = open_store(target, fresh=False)
    assert len(s) == 10 and not s.recovery["unclean"]
    out = [torch.zeros(NUMEL, dtype=torch.int32) for _ in range(10)]
    assert all(s.get([key(i) for i in range(10)], out))
    assert all(torch.equal(out[i], content(i)) for i in range(10))
    # the chain structure came back too: the leaf goes first
    assert s._slots.peek_victim() == key(9)
    s.close()


def test_stored_pages_leave_no_objects_for_the_garbage_collector(tmp_path):
    """Pages live in the store for hours: an object per page that a full collection must walk
    pauses every thread of an SGLang process in proportion to the namespace (125 ms per million)."""
    import gc

    s = open_store(str(tmp_path / "ns.img"), create_bytes=64 << 20)
    n = 2_000
    keys = [key(i) for i in range(n)]
    src = content(0)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(0, n, 200):
        assert all(s.put(keys[i:i + 200], [src] * 200, [None] + keys[i:i + 199]).ok)
    out = [torch.zeros(NUMEL, dtype=torch.int32) for _ in range(200)]
    assert all(s.get(keys[:200], out))
    del out
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert len(s) == n and grown < 200, f"{grown} objects tracked by the garbage collector for {n} pages"
    s.close()


def test_full_store_evicts_leaves_first_lru(tmp_path):
    s = open_store(str(tmp_path / "ns.img"), create_bytes=SIXTY_FOUR_SLOTS)
    cap = s.capacity_pages
    assert cap == 64
    # chain A: 0 -> 1 -> ... -> 39 (a shared system prompt), then 24 single-page requests
    s.put([key(i) for i in range(40)], [content(i) for i in range(40)], [None] + [key(i) for i in range(39)])
    s.put([key(100 + i) for i in range(24)], [content(100 + i) for i in range(24)], [key(39)] * 24)
    s.touch([key(i) for i in range(40)])  # the prefix is hot; its leaves are the requests
    res = s.put([key(500 + i) for i in range(30)], [content(500 + i) for i in range(30)])
    assert all(res.ok) and len(res.evicted) == 30
    # the 24 request leaves go first, then the chain from its tail, never a parent before a child
    assert res.evicted[:24] == [key(100 + i) for i in range(24)]
    assert res.evicted[24:] == [key(39 - i) for i in range(6)]
    assert s.leading_run([key(i) for i in range(40)]) == 34
    s.close()


def test_plain_lru_mode_breaks_chains(tmp_path):
    s = open_store(str(tmp_path / "ns.img"), create_bytes=SIXTY_FOUR_SLOTS, eviction="lru")
    s.put([key(i) for i in range(64)], [content(i) for i in range(64)], [None] + [key(i) for i in range(63)])
    res = s.put([key(900)], [content(900)])
    assert res.evicted == [key(0)]  # the root goes first: the whole chain is now unreachable as a prefix
    assert s.leading_run([key(i) for i in range(64)]) == 0
    s.close()


WRITER = textwrap.dedent("""
    import hashlib, os, signal, sys, numpy as np, torch
    from radixtier.testing.pages import page_content
    from radixtier.storage.nvmeof import store as nvmeof_store
    from radixtier.storage.nvmeof.store import NvmeofPageStore
    from radixtier.storage.nvmeof.slots import SlotTable
    s = NvmeofPageStore({path!r}, {page}, create_bytes=32 << 20, partition={part}, node_id="writer")
    crash_at, crash_in = {crash_at}, {crash_in!r}
    puts = 0
    if crash_in:  # die exactly at one step of a put: SIGKILL, as an OOM kill or kill -9 would
        target = nvmeof_store.os if crash_in == "fdatasync" else SlotTable  # flush: the slot table's write
        real = getattr(target, crash_in)
        def dying(*a, **k):
            if puts == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(target, crash_in, dying)
    i = {start}
    while True:
        batch = [hashlib.blake2b(str(j).encode(), digest_size=16).digest() for j in range(i, i + 4)]
        res = s.put(batch, [page_content(k, {numel}) for k in batch])
        puts += 1
        for k, ok in zip(batch, res.ok):
            if ok:
                print(k.hex(), flush=True)
        i += 4
""")


def _run_writer(path, wait_lines=None, start=0, crash_at=0, crash_in=""):
    """Keys the writer acknowledged before it died (killed from outside after wait_lines acks,
    or by itself inside `crash_in` during put number crash_at)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(path=path, page=PAGE, part=0,
                                                                 numel=NUMEL, start=start, crash_at=crash_at,
                                                                 crash_in=crash_in)],
                            stdout=subprocess.PIPE, text=True)
    acked = []
    deadline = time.monotonic() + 60
    while (wait_lines is None or len(acked) < wait_lines) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked.append(bytes.fromhex(line.strip()))
    if wait_lines is not None:
        os.kill(proc.pid, signal.SIGKILL)  # mid-write: the writer never stops between puts
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return acked


def _recovered_pages_are_intact(path, acked):
    s = NvmeofPageStore(path, PAGE, node_id="writer")
    assert s.recovery["unclean"] and s.recovery["verify"] == "headers"
    keys = [k for k, _p, _l in s.entries()]
    assert set(acked) <= set(keys), "a page acknowledged before the kill was lost"
    out = [torch.zeros(NUMEL, dtype=torch.int32) for _ in keys]
    ok = s.get(keys, out)
    assert all(ok), "a recovered page failed verification"
    for k, buf in zip(keys, out):
        assert torch.equal(buf, page_content(k, NUMEL)), "recovered page bytes differ"
    s.close()
    return keys


def test_kill_9_during_writes_recovers_every_completed_page(tmp_path):
    path = str(tmp_path / "ns.img")
    for attempt, wait_lines in enumerate([5, 37, 150]):
        acked = _run_writer(path, wait_lines, start=attempt * 100_000)  # new pages each time
        assert len(acked) >= wait_lines, "writer did not start"
        _recovered_pages_are_intact(path, acked)


@pytest.mark.parametrize("crash_in", ["fdatasync", "flush"])
def test_kill_between_data_and_table_loses_only_the_unfinished_batch(tmp_path, crash_in):
    """Killed after the data is written but before its table entries are: on restart the batch
    in flight does not exist (no partial page), and every acknowledged one does."""
    path = str(tmp_path / "ns.img")
    acked = _run_writer(path, crash_at=9, crash_in=crash_in)
    assert len(acked) == 9 * 4
    keys = _recovered_pages_are_intact(path, acked)
    assert set(keys) == set(acked)  # the tenth batch, whose entries never landed, is absent


READER = textwrap.dedent("""
    import json, sys, torch
    from radixtier.testing.pages import page_content
    from radixtier.storage.nvmeof.store import NvmeofPageStore
    from radixtier.storage.api import PageLocation
    s = NvmeofPageStore({path!r}, {page}, partition=1, node_id="node-b")
    good = 0
    for rec in json.loads(sys.stdin.read()):
        buf = torch.zeros({numel}, dtype=torch.int32)
        key = bytes.fromhex(rec["key"])
        if s.read_location(PageLocation(**rec["loc"]), key, buf) and torch.equal(buf, page_content(key, {numel})):
            good += 1
    own = s.put([bytes(16)], [torch.ones({numel}, dtype=torch.int32)])
    print(json.dumps({{"good": good, "own_slot": s.location(bytes(16)).slot, "ok": own.ok}}))
    s.close()
""")


def test_two_processes_share_one_namespace(tmp_path):
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20, partitions=2)
    a = NvmeofPageStore(path, PAGE, partition=0, node_id="node-a")
    a.put([key(i) for i in range(6)], [content(i) for i in range(6)])
    recs = [{"key": key(i).hex(), "loc": a.location(key(i)).__dict__} for i in range(6)]
    out = subprocess.run([sys.executable, "-c", READER.format(path=path,
                                                              page=PAGE, numel=NUMEL)],
                         input=json.dumps(recs), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["good"] == 6  # node B read node A's pages byte-identical, verified by their headers
    assert res["ok"] == [True] and res["own_slot"] in a.sb.partition_range(1)  # B writes only its range
    assert all(a.location(key(i)).slot in a.sb.partition_range(0) for i in range(6))
    a.close()


def test_same_partition_twice_is_refused(tmp_path):
    path = str(tmp_path / "ns.img")
    a = open_store(path)
    with pytest.raises(RuntimeError, match="already open"):
        NvmeofPageStore(path, PAGE)
    code = ("import sys\nfrom radixtier.storage.nvmeof.store import NvmeofPageStore\n"
            f"try:\n    NvmeofPageStore({path!r}, {PAGE})\nexcept RuntimeError as e:\n    print(e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "another process" in out.stdout
    a.close()


def test_bad_configuration_errors(tmp_path):
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=8 << 20)
    with pytest.raises(FormatError, match="already a radixtier namespace"):
        format_namespace(path, PAGE, capacity_bytes=8 << 20)
    with pytest.raises(FormatError, match="page_bytes=16384, asked for page_bytes=8192"):
        NvmeofPageStore(path, 8192)
    with pytest.raises(ValueError, match="partition: expected 0..0"):
        NvmeofPageStore(path, PAGE, partition=1)
    other = str(tmp_path / "other.bin")
    with open(other, "wb") as f:
        f.write(b"precious data" * 1000)
    with pytest.raises(FormatError, match="holds other data"):
        format_namespace(other, PAGE, capacity_bytes=8 << 20)
    with pytest.raises(FormatError, match="not a radixtier namespace"):
        NvmeofPageStore(other, PAGE)
    with open(other, "rb") as f:
        assert f.read(13) == b"precious data"  # never silently overwritten
    with pytest.raises(ValueError, match="capacity"):
        format_namespace(str(tmp_path / "tiny.img"), PAGE, capacity_bytes=20000)
    with pytest.raises(ValueError, match="eviction"):
        NvmeofPageStore(path, PAGE, eviction="random")
    with pytest.raises(ValueError, match="io_engine"):
        NvmeofPageStore(path, PAGE, io_engine="aio")
    s = NvmeofPageStore(path, PAGE)
    with pytest.raises(ValueError, match="key: expected 16 bytes"):
        s.put([b"short"], [content(0)])
    with pytest.raises(ValueError, match="at most 16384 bytes"):
        s.put([key(0)], [torch.zeros(NUMEL + 1, dtype=torch.int32)])
    s.put([key(0)], [content(0)])
    with pytest.raises(ValueError, match="stored page has 16384"):
        s.get([key(0)], [torch.zeros(10, dtype=torch.int32)])
    s.close()


def test_a_file_namespace_reserves_its_space_at_format(tmp_path, capsys):
    """The format allocates a file namespace's blocks (a full disk fails here, not on a later
    write); a namespace bigger than the filesystem's room is refused before anything is allocated,
    with one line naming the capacity, and leaves no file."""
    import shutil

    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=8 << 20)
    assert os.stat(path).st_blocks * 512 >= 8 << 20  # allocated, not sparse
    free_before = shutil.disk_usage(tmp_path).free
    huge = str(tmp_path / "huge.img")
    too_big = free_before + (64 << 30)
    assert cli_main(["format", huge, "--page-bytes", "16KiB", "--capacity", str(too_big)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "capacity" in err[0] and "room" in err[0], err
    assert not os.path.exists(huge)
    assert shutil.disk_usage(tmp_path).free > free_before - (64 << 20)  # nothing was filled on the way


def test_cli_format_and_inspect(tmp_path, capsys):
    path = str(tmp_path / "cli.img")
    assert cli_main(["format", path, "--page-bytes", "16KiB", "--capacity", "8MiB", "--partitions", "2"]) == 0
    assert "formatted" in capsys.readouterr().out
    assert cli_main(["format", path, "--page-bytes", "16KiB", "--capacity", "8MiB"]) == 2
    assert "already a radixtier namespace" in capsys.readouterr().err
    s = NvmeofPageStore(path, PAGE, partition=1, node_id="node-b")
    s.put([key(i) for i in range(5)], [content(i) for i in range(5)])
    s.close()
    assert cli_main(["inspect", path, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "5 used" in out and "node-b on" in out and "(closed cleanly)" in out and "errors: 0" in out


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_close_waits_for_a_running_read_and_refuses_new_calls(tmp_path, monkeypatch, engine):
    """SGLang's transfer threads may still be inside get/put when the backend closes the store."""
    import threading

    _skip_without(engine)
    s = open_store(str(tmp_path / "ns.img"), io_engine=engine)
    assert all(s.put([key(i) for i in range(4)], [content(i) for i in range(4)]).ok)
    started = threading.Event()
    name = "read_pages" if s._engine.native_pages else "run"
    real = getattr(s._engine, name)

    def slow(*args):
        started.set()
        time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(s._engine, name, slow)
    out, result = [torch.zeros(NUMEL, dtype=torch.int32) for _ in range(4)], {}
    reader = threading.Thread(target=lambda: result.setdefault("ok", s.get([key(i) for i in range(4)], out)))
    reader.start()
    assert started.wait(5)
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t >= 0.3  # it waited for the read in flight
    reader.join(5)
    assert result["ok"] == [True] * 4 and all(torch.equal(out[i], content(i)) for i in range(4))
    with pytest.raises(RuntimeError, match="closed"):
        s.get([key(0)], [out[0]])


def test_an_empty_file_without_capacity_is_no_namespace_not_a_missing_one(tmp_path):
    """Only a missing path, or an empty file the caller asked to create (create_bytes), is created;
    an empty file otherwise is read like any target and refused as no namespace (found by review:
    the split store said "not a formatted namespace; give create_bytes" and SGLang's attach let a
    bare FileNotFoundError out)."""
    from radixtier.storage.nvmeof.layout import FormatError

    path = tmp_path / "ns.img"
    path.write_bytes(b"")
    with pytest.raises(FormatError):
        NvmeofPageStore(str(path))
    assert path.stat().st_size == 0
    with pytest.raises(FileNotFoundError):
        NvmeofPageStore(str(tmp_path / "missing.img"))


def test_a_namespace_handed_to_the_store_is_closed_when_the_store_refuses(tmp_path):
    """The store takes an opened namespace over: whatever it refuses (an unknown option, a bad node
    id, a page size the namespace does not have), the descriptor is closed, never leaked."""
    from radixtier.storage.nvmeof.namespace import open_namespace

    path = str(tmp_path / "ns.img")
    NvmeofPageStore(path, PAGE, create_bytes=8 << 20).close()
    for kwargs, error in (({"queue_dpeth": 4}, TypeError), ({"node_id": "a:b"}, ValueError),
                          ({"page_bytes": PAGE * 2}, ValueError), ({"partition": 5}, ValueError)):
        ns = open_namespace(path)
        page_bytes = kwargs.pop("page_bytes", None)
        with pytest.raises(error):
            NvmeofPageStore(ns, page_bytes, **kwargs)
        assert ns.target.fd == -1, kwargs


def test_a_put_that_fails_inside_its_commit_gives_each_slot_back_once(tmp_path, monkeypatch):
    """A failure after some of a batch's slots were committed or released (here: the eviction order
    refuses the third page) gives back only the rest, once each: no slot on the free list twice
    (which would hand one slot to two pages), none lost, the index and the order agree."""
    from radixtier import eviction

    s = open_store(str(tmp_path / "ns.img"), io_engine="threads")
    real, calls = eviction.EvictionOrder.add, [0]

    def failing_add(self, key, parent=None, pinned=False):
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("injected")
        return real(self, key, parent, pinned)

    monkeypatch.setattr(eviction.EvictionOrder, "add", failing_add)
    with pytest.raises(MemoryError):
        s.put([key(i) for i in range(6)], [content(i) for i in range(6)])
    monkeypatch.setattr(eviction.EvictionOrder, "add", real)
    slots = s._slots
    with slots._lock:
        free = list(slots._free)
        used = [v[0] for v in slots._index.values()]
        assert len(free) == len(set(free)), "a slot is on the free list twice"
        assert sorted(free + used) == list(range(s.capacity_pages)), "a slot was lost or doubled"
        assert set(slots._index) == set(slots._order)
    assert len(s) == 2 and all(s.put([key(i) for i in range(6)], [content(i) for i in range(6)]).ok)
    s.close()
