"""Partition leases under slow I/O, paused holders, skewed clocks and kills (issue 28, items 1-3, 7).

Each "host" is a child process; a second host is a child in its own pid namespace (`unshare
--pid`), which is what a process on another machine looks like to the lease: its pid cannot be
checked, so only the lease protocol keeps the two apart. Faults are injected into the child's lease
I/O (radixtier/storage/nvmeof/lease.py read_block / write_block). Every round counts the pages each opener
acknowledged and checks them afterwards from a fresh opener: none may be lost or wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from radixtier.storage.nvmeof.store import NvmeofPageStore, format_namespace

PAGE = 16 << 10
HOST = textwrap.dedent("""
    import hashlib, json, os, sys, threading, time
    cfg = json.loads(sys.argv[1])
    if cfg.get("log"):
        import logging; logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d " + cfg["name"] + " %(message)s")
    from radixtier.storage.nvmeof import lease as lease_mod
    from radixtier.storage.nvmeof.lease import LeaseError
    from radixtier.storage.nvmeof.store import NvmeofPageStore
    import torch

    def slowed(fn, delay):
        def wrapper(*a, **k):
            time.sleep(delay)
            return fn(*a, **k)
        return wrapper

    if cfg.get("write_delay"):  # the lease write reaches the system call this much later
        lease_mod.write_block = slowed(lease_mod.write_block, cfg["write_delay"])
    if cfg.get("read_returns_at"):  # the first lease read returns (its data read at once) at this wall time
        real_read = lease_mod.read_block
        def held_read(*a, **k):
            data = real_read(*a, **k)
            if not cfg.get("held"):
                cfg["held"] = True
                while time.time() < cfg["read_returns_at"]:
                    time.sleep(0.001)
            return data
        lease_mod.read_block = held_read
    if cfg.get("op_delay"):  # every page I/O of the thread-pool engine takes this much longer
        from radixtier.storage.nvmeof import io_engine
        io_engine._run_one = slowed(io_engine._run_one, cfg["op_delay"])
    if cfg.get("clock_skew_s"):
        real = time.time_ns
        lease_mod.time.time_ns = lambda: real() + int(cfg["clock_skew_s"] * 1e9)
    if cfg.get("wait_for_go"):  # imports done: the test sends the start time (and what is relative to it)
        print(json.dumps({{"ready": True}}), flush=True)
        cfg.update(json.loads(sys.stdin.readline()))
    while time.time() < cfg.get("start_at", 0):
        time.sleep(0.001)
    retry_until = time.monotonic() + cfg.get("retry_s", 0)
    while True:
        try:
            s = NvmeofPageStore(cfg["path"], {page}, node_id=cfg["name"], lease_s=cfg["lease_s"],
                                lease_io_timeout_s=cfg["io_s"], io_engine=cfg.get("engine", "auto"))
            break
        except LeaseError as e:
            if "for another" in str(e) and time.monotonic() < retry_until:
                time.sleep(0.1)  # a live-looking lease: wait for its expiry, as an operator's restart loop would
                continue
            print(json.dumps({{"opened": False, "why": str(e)}}), flush=True)
            sys.exit(0)
    print(json.dumps({{"opened": True}}), flush=True)
    acked, n, end = [], 0, time.monotonic() + cfg["write_s"]
    batch = cfg.get("batch", 8)
    while time.monotonic() < end:
        if cfg.get("until_fenced") and s.fenced:  # the event the test waits for: no need to write on until end
            break
        if n >= cfg.get("max_pages", 400):  # no eviction: every acknowledged page must read back
            time.sleep(0.01)
            continue
        keys = [hashlib.blake2b(f"{{cfg['name']}}-{{n + i}}".encode(), digest_size=16).digest() for i in range(batch)]
        bufs = [torch.full(({page} // 4,), n + i, dtype=torch.int32) for i in range(batch)]
        res = s.put(keys, bufs)
        acked += [[k.hex(), n + i] for i, (k, ok) in enumerate(zip(keys, res.ok)) if ok]
        n += batch
        if cfg.get("announce"):
            print(json.dumps({{"wrote": len(acked)}}), flush=True)
    print(json.dumps({{"acked": acked, "fenced": s.fenced}}), flush=True)
    s.close()
""").format(page=PAGE)


def _unshare_prefix() -> list:
    """The command prefix that runs a child as 'another host' (its own pid namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: no second pid namespace for a second host")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"new pid namespaces are not permitted here (unshare: {probe.stderr.strip()})")
    return ["unshare", "--pid", "--fork"]


def _host(cfg: dict, other_host: bool) -> subprocess.Popen:
    cmd = ([*_unshare_prefix()] if other_host else []) + [sys.executable, "-c", HOST, json.dumps(cfg)]
    # its own session: signals go to the whole group (unshare's child included), and stray output stays ours
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _go(procs: list, timings) -> None:
    """Wait until every child (started with wait_for_go) has done its imports, then send each its
    timings (a function of the shared start time): the race starts on an event, not a guessed delay."""
    for p in procs:
        line = p.stdout.readline()
        assert '"ready"' in line, f"host child failed before it was ready: {line!r}\n{p.stderr.read()[-3000:]}"
    start_at = time.time() + 0.2
    for i, p in enumerate(procs):
        p.stdin.write(json.dumps(timings(i, start_at)) + "\n")
        p.stdin.flush()


def _outcome(proc: subprocess.Popen, timeout: float = 120, seen: tuple = ()) -> dict:
    """What a host child printed (JSON lines), merged; `seen`: lines the test already read."""
    out, err = proc.communicate(timeout=timeout)
    merged: dict = {"opened": True} if seen else {}
    for line in out.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    assert "opened" in merged, f"host child failed (rc {proc.returncode}):\n{err[-3000:]}"
    return merged


def _lost(path: str, acked_by: dict) -> int:
    """Acknowledged pages that a fresh opener does not read back exactly."""
    import torch

    s = NvmeofPageStore(path, PAGE, node_id="checker", lease_s=4, lease_io_timeout_s=0.05, force_takeover=True)
    try:
        lost = 0
        for pages in acked_by.values():
            for key_hex, value in pages:
                out = torch.zeros(PAGE // 4, dtype=torch.int32)
                ok = s.get([bytes.fromhex(key_hex)], [out]) == [True]
                lost += not (ok and bool((out == value).all()))
        return lost
    finally:
        s.close()


@pytest.mark.parametrize("fault", ["write_delay", "read_delay"])
def test_two_hosts_opening_at_once_with_slow_lease_io_never_both_own_it(tmp_path, fault):
    """The old protocol trusted a 0.1 s settle: a lease write 0.3 s late let both hosts open the
    partition (6 of 6 rounds) and 1,070 of 2,388 acknowledged pages were lost. Both hosts read the
    empty block before either writes (their reads return 0.2 s later); then one host's write is
    0.3 s late ("write_delay"), or its read returns 0.3 s after the other's ("read_delay"). Now the
    read-to-write gap and the wait before reading back are both bounded by the lease I/O timeout
    (0.5 s here): exactly one host opens, and no acknowledged page is lost."""
    _unshare_prefix()
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    rounds = []
    for rnd in range(3):
        slow = rnd % 2  # which host's lease I/O is slowed
        procs = []
        for h in range(2):
            cfg = {"path": path, "name": f"host{h}-r{rnd}", "lease_s": 4.0, "io_s": 0.5, "wait_for_go": True,
                   "write_s": 1.0}
            if h == slow and fault == "write_delay":
                cfg["write_delay"] = 0.3
            procs.append(_host(cfg, other_host=(h == 1)))
        # both children past their imports, then they race from the same moment
        _go(procs, lambda h, start_at: {"start_at": start_at, "read_returns_at": start_at + (
            0.5 if h == slow and fault == "read_delay" else 0.2)})
        outs = [_outcome(p) for p in procs]
        opened = [o["opened"] for o in outs]
        acked = {f"host{h}": o.get("acked", []) for h, o in enumerate(outs)}
        lost = _lost(path, acked)
        why = next(("both wrote, read-back refused it" if "took it while this one did" in o["why"]
                    else "read the winner's record" for o in outs if not o["opened"]), "")
        rounds.append((opened, sum(len(v) for v in acked.values()), lost, why))
        assert sum(opened) <= 1 and lost == 0, f"round {rnd}: opened {opened}, {lost} acknowledged pages lost"
        assert sum(opened) == 1, f"round {rnd}: neither host opened the partition: {outs}"
    print(f"\n{fault} 0.3 s: rounds (opened, pages acknowledged, lost, why the other was refused): {rounds}")


def test_a_paused_holder_writes_nothing_after_another_host_took_over(tmp_path):
    """Host A is SIGSTOPped mid-batch past its lease; host B waits its lease out, watches it, takes
    the partition and writes; A resumes: A's remaining submissions find their deadline passed (checked
    in C before each one), so none of B's acknowledged pages is lost."""
    _unshare_prefix()
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    rounds = []
    for rnd in range(3):
        engine = ["io_uring", "threads", "threads"][rnd]  # threads: each page I/O slowed, batches last ~0.2 s
        a = _host({"path": path, "name": f"a{rnd}", "lease_s": 1.6, "io_s": 0.1, "write_s": 12.0,
                   "batch": 64, "announce": True, "max_pages": 1 << 30, "engine": engine, "until_fenced": True,
                   "op_delay": 0.05 if engine == "threads" else 0},
                  other_host=True)  # A writes without a break: the stop lands inside a batch
        line = a.stdout.readline()
        assert json.loads(line)["opened"], line
        while '"wrote"' not in a.stdout.readline():  # A is writing batches now
            pass
        time.sleep(0.05 * rnd)
        os.killpg(a.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        b = _host({"path": path, "name": f"b{rnd}", "lease_s": 1.6, "io_s": 0.1, "write_s": 1.2,
                   "announce": True, "retry_s": 10}, other_host=False)
        first = json.loads(b.stdout.readline())
        assert first["opened"], first
        took_s = time.monotonic() - t0
        time.sleep(0.3)  # B is writing
        os.killpg(a.pid, signal.SIGCONT)
        out_b = _outcome(b, seen=("opened",))
        out_a = _outcome(a, seen=("opened",))
        lost = _lost(path, {"b": out_b["acked"]})
        rounds.append((len(out_b["acked"]), lost, round(took_s, 1)))
        assert "taken over" in out_a["fenced"] or "not renewed" in out_a["fenced"], out_a["fenced"]
        assert lost == 0, f"round {rnd}: {lost} of B's {len(out_b['acked'])} acknowledged pages lost"
    print(f"\npaused holder: rounds (B's pages acknowledged, lost, s until B opened): {rounds}")


def test_a_skewed_clock_does_not_take_a_live_lease(tmp_path):
    """B's wall clock runs 60 s ahead: A's lease looks expired to it. B watches the record, sees A
    renew, and is refused with the clock difference named; A's pages are intact."""
    _unshare_prefix()
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    a = _host({"path": path, "name": "a", "lease_s": 1.6, "io_s": 0.1, "write_s": 4.0, "announce": True},
              other_host=True)
    assert json.loads(a.stdout.readline())["opened"]
    b = _host({"path": path, "name": "b", "lease_s": 1.6, "io_s": 0.1, "write_s": 1.0, "clock_skew_s": 60},
              other_host=False)
    out_b = _outcome(b)
    out_a = _outcome(a, seen=("opened",))
    assert not out_b["opened"] and "renewed its lease while this opener watched" in out_b["why"], out_b
    assert "clocks differ" in out_b["why"]
    assert out_a["fenced"] == "" and _lost(path, {"a": out_a["acked"]}) == 0


def test_kill_9_during_acquisition_leaves_nothing_that_blocks_or_doubles(tmp_path):
    """Openers killed at random moments of acquisition (before, during and after the lease write)
    never leave the partition unopenable here, and never two live owners."""
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    for rnd in range(6):
        procs = [_host({"path": path, "name": f"k{rnd}{h}", "lease_s": 1.6, "io_s": 0.1, "write_s": 0.3,
                        "wait_for_go": True}, other_host=False) for h in range(2)]
        _go(procs, lambda h, start_at: {"start_at": start_at})  # both past their imports, then both open
        time.sleep(0.2 + 0.07 * rnd)  # from before the first opener's lease write to past its settle (0.25 s)
        os.killpg(procs[0].pid, signal.SIGKILL)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        survivor = [json.loads(line) for line in outs[1].splitlines() if line.startswith("{")]
        opened = [o for o in survivor if "opened" in o]
        assert opened, f"round {rnd}: the surviving opener printed nothing: {outs[1]!r}"
        s = NvmeofPageStore(path, PAGE, node_id="after", lease_s=1.6, lease_io_timeout_s=0.1)
        s.close()


def test_a_failed_open_whose_lease_write_landed_does_not_lock_the_partition(tmp_path, monkeypatch):
    """A lease write that reported ENOSPC but landed left a record naming this live process: every
    retry here and every other process was refused "open in another process (pid <own>)" until exit."""
    from radixtier.storage.nvmeof import lease as lease_mod

    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    real = lease_mod.write_block
    calls = []

    def landed_but_failed(t, offset, data, deadline):
        real(t, offset, data, deadline)
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(lease_mod, "write_block", landed_but_failed)
    with pytest.raises(OSError, match="No space"):
        NvmeofPageStore(path, PAGE)
    monkeypatch.setattr(lease_mod, "write_block", real)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from radixtier.storage.nvmeof.store import NvmeofPageStore
        NvmeofPageStore({path!r}, {PAGE}, node_id="other").close()
        print("opened")
    """)], capture_output=True, text=True, timeout=60)
    assert "opened" in child.stdout, child.stderr[-2000:]
    s = NvmeofPageStore(path, PAGE)  # and a retry in this process
    s.close()


def test_no_lock_file_and_a_planted_symlink_is_never_followed(tmp_path, monkeypatch):
    """The old host lock opened /run/lock/radixtier-<uuid>-p<N>.lock with O_CREAT and truncated it:
    a local user's symlink there made the (root) service overwrite the file it points to, a foreign
    flock on it kept the service from opening, and the files were never removed."""
    import fcntl

    lock_dir = tmp_path / "lockdir"
    lock_dir.mkdir()
    monkeypatch.setenv("RADIXTIER_LOCK_DIR", str(lock_dir))
    path = str(tmp_path / "ns.img")
    sb = format_namespace(path, PAGE, capacity_bytes=16 << 20)
    victim = tmp_path / "root-only"
    victim.write_text("precious\n")
    (lock_dir / f"radixtier-{sb.uuid}-p0.lock").symlink_to(victim)
    s = NvmeofPageStore(path, PAGE)
    s.close()
    assert victim.read_text() == "precious\n"
    (lock_dir / f"radixtier-{sb.uuid}-p0.lock").unlink()
    held = open(lock_dir / f"radixtier-{sb.uuid}-p0.lock", "w")
    held.write("pid 1 \x1b[31mevil\n")
    held.flush()
    fcntl.flock(held, fcntl.LOCK_EX)  # a local user holding the old lock file
    try:
        s = NvmeofPageStore(path, PAGE)
        s.close()
    finally:
        held.close()
    assert os.listdir(lock_dir) == []  # an old version's leftover (a regular file of ours) is removed
    (lock_dir / "radixtier-other-p0.lock").write_text("")
    for _ in range(3):
        NvmeofPageStore(path, PAGE).close()
    assert os.listdir(lock_dir) == ["radixtier-other-p0.lock"]  # nothing created; other namespaces' left alone


def test_a_live_holder_on_this_machine_is_refused_at_once(tmp_path):
    """Without a lock file, a live holder in another process here is still refused immediately
    (its lease record names this boot, pid namespace and a live pid)."""
    path = str(tmp_path / "ns.img")
    format_namespace(path, PAGE, capacity_bytes=16 << 20)
    a = _host({"path": path, "name": "a", "lease_s": 1.6, "io_s": 0.1, "write_s": 3.0, "announce": True},
              other_host=False)
    assert json.loads(a.stdout.readline())["opened"]
    t0 = time.monotonic()
    from radixtier.storage.nvmeof.lease import LeaseError

    with pytest.raises(LeaseError, match=r"open in another process: node 'a'"):
        NvmeofPageStore(path, PAGE, lease_s=1.6, lease_io_timeout_s=0.1)
    assert time.monotonic() - t0 < 1.0
    os.killpg(a.pid, signal.SIGKILL)
    a.communicate(timeout=60)
    s = NvmeofPageStore(path, PAGE, lease_s=1.6, lease_io_timeout_s=0.1)  # dead holder here: taken at once
    assert s.recovery["unclean"] and s.recovery["lease_waited_s"] == 0
    s.close()


def test_lease_timing_is_validated(tmp_path):
    path = str(tmp_path / "ns.img")
    for kwargs, match in [({"lease_s": 0.001}, "lease_s: expected a number of seconds from 0.4 to 3600"),
                          ({"lease_s": 1e308}, "lease_s: expected"),
                          ({"lease_s": float("nan")}, "lease_s: expected"),
                          ({"lease_io_timeout_s": 0}, "lease_io_timeout_s: expected"),
                          ({"lease_io_timeout_s": 5.0}, "lease_s: expected a number of seconds from 40 to")]:
        with pytest.raises(ValueError, match=match):
            NvmeofPageStore(path, PAGE, create_bytes=8 << 20, **kwargs)
        assert not os.path.exists(path)  # refused before anything was created
    for bad in (None, "", "a\x00b"):
        with pytest.raises(ValueError, match="path: expected"):
            NvmeofPageStore(bad, PAGE)
    for bad in ("a\x00b", "tab\there", "esc\x1b[31m"):
        with pytest.raises(ValueError, match=r"^node_id: expected 1-48 printable bytes"):
            NvmeofPageStore(path, PAGE, create_bytes=8 << 20, node_id=bad)
        assert not os.path.exists(path)


def test_record_state_after_a_clean_close_needs_no_wait(tmp_path):
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20)
    s.close()
    t0 = time.monotonic()
    s = NvmeofPageStore(path, PAGE)
    assert s.recovery["lease_waited_s"] == 0 and not s.recovery["unclean"]
    assert time.monotonic() - t0 < 2.0
    s.close()


@pytest.mark.parametrize("engine", ["io_uring", "threads"])
def test_no_write_is_issued_past_its_deadline(tmp_path, engine):
    """The engines check the deadline right before each submission (C for io_uring and, where the
    native core is built, for pwritev): a write whose deadline passed never reaches the file."""
    import errno as errno_mod
    import mmap

    from radixtier.storage.nvmeof.io_engine import IOOp, make_engine

    try:
        eng = make_engine(engine, 4)
    except ValueError as exc:
        pytest.skip(str(exc))
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 8192)
    fd = os.open(path, os.O_RDWR)
    buf = mmap.mmap(-1, 4096)
    buf[:] = b"x" * 4096
    try:
        past = time.monotonic() - 0.001
        try:
            res = eng.run([IOOp(True, fd, 0, [memoryview(buf)]), IOOp(True, fd, 4096, [memoryview(buf)])],
                          deadline=past)
            assert res == [-errno_mod.ETIME] * 2
        except OSError as exc:
            assert exc.errno == errno_mod.ETIME
        assert path.read_bytes() == b"\0" * 8192
        assert eng.run([IOOp(True, fd, 0, [memoryview(buf)])], deadline=time.monotonic() + 60) == [4096]
        assert path.read_bytes()[:4096] == b"x" * 4096
    finally:
        os.close(fd)
        eng.close()


def test_a_lapsed_store_refuses_page_and_table_writes(tmp_path, monkeypatch):
    """Past its deadline a store writes neither pages nor table blocks, even when put() is entered
    before the deadline and the writes would be issued after it (a pause between the two)."""
    from radixtier.storage.nvmeof import lease as lease_mod
    import torch

    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, lease_s=1.6, lease_io_timeout_s=0.1)
    real_deadline = lease_mod.PartitionLease.write_deadline
    monkeypatch.setattr(lease_mod.PartitionLease, "write_deadline",
                        lambda self: real_deadline(self) - 1000.0)  # as if paused 1000 s after the check
    with open(path, "rb") as f:
        before = f.read()
    res = s.put([bytes([i]) * 16 for i in range(8)], [torch.full((PAGE // 4,), i, dtype=torch.int32) for i in range(8)])
    assert res.ok == [False] * 8 and s.stats()["fenced_writes"] >= 8
    with open(path, "rb") as f:
        assert f.read() == before  # not a byte of data, header or table reached the file
    monkeypatch.setattr(lease_mod.PartitionLease, "write_deadline", real_deadline)
    s.close()


def test_the_sglang_backend_takes_and_checks_the_lease_timing():
    from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError

    cfg = BackendConfig.from_extra_config({"path": "/nonexistent/ns.img", "lease_s": 4, "lease_io_timeout_s": 0.5})
    assert (cfg.store.lease_s, cfg.store.lease_io_timeout_s) == (4.0, 0.5)
    with pytest.raises(ConfigError, match=r"^lease_s: expected a number of seconds from 4 to 3600, got 1\.0$"):
        BackendConfig.from_extra_config({"path": "/nonexistent/ns.img", "lease_s": 1, "lease_io_timeout_s": 0.5})
    with pytest.raises(ConfigError, match=r"^lease_io_timeout_s: expected"):
        BackendConfig.from_extra_config({"path": "/nonexistent/ns.img", "lease_io_timeout_s": "nan"})


def test_a_close_with_a_put_still_running_then_a_reopen_here_loses_nothing(tmp_path):
    """close() that gives up waiting for a running put leaves the lease HELD ("keep"); a reopen in
    the same process takes it back, and the old put -- resuming later -- must not write its table
    blocks over the new store's entries (found by review: 4 of 4 acknowledged pages were lost)."""
    import threading

    import torch

    path = str(tmp_path / "ns.img")

    def page(i):
        return torch.full((PAGE // 4,), i, dtype=torch.int32)

    def key(i):
        return i.to_bytes(16, "little")

    s1 = NvmeofPageStore(path, PAGE, create_bytes=8 << 20, lease_s=1.6, lease_io_timeout_s=0.1)
    assert all(s1.put([key(i) for i in range(4)], [page(i) for i in range(4)]).ok)
    real = s1._slots.flush

    def slow(blocks):
        time.sleep(1.0)  # a put slowed in Python (a GC pause, the GIL) after its data landed
        return real(blocks)

    s1._slots.flush = slow  # the slot table's flush, which a put runs after its data landed
    late = []
    t = threading.Thread(target=lambda: late.append(s1.put([key(i) for i in (10, 11)], [page(10), page(11)]).ok))
    t.start()
    time.sleep(0.1)
    s1.close(timeout=0.1)  # not drained: the lease is kept HELD
    t0 = time.monotonic()
    s2 = NvmeofPageStore(path, PAGE, lease_s=1.6, lease_io_timeout_s=0.1)
    assert time.monotonic() - t0 < 1.6 + 1.0  # waited until s1's writes could no longer be issued, no longer
    assert all(s2.put([key(i) for i in range(20, 24)], [page(i) for i in range(20, 24)]).ok)
    t.join()
    assert late == [[False, False]]  # the old store wrote no table entry after its close
    s2.close()
    s3 = NvmeofPageStore(path, PAGE)
    out = torch.zeros(PAGE // 4, dtype=torch.int32)
    for i in range(20, 24):
        assert s3.get([key(i)], [out]) == [True] and bool((out == i).all())
    s3.close()


def test_a_damaged_lease_block_is_watched_not_taken_at_once(tmp_path):
    """A block that fails its CRC (a torn read of a live holder's write, or damage) is read again,
    then watched like a silent holder's record: never taken at once."""
    path = str(tmp_path / "ns.img")
    sb = format_namespace(path, PAGE, capacity_bytes=8 << 20)
    with open(path, "r+b") as f:
        f.seek(sb.lease_offset(0))
        f.write(b"RTLS" + os.urandom(200))
    s = NvmeofPageStore(path, PAGE, lease_s=0.4)
    assert s.recovery["unclean"] and s.recovery["lease_waited_s"] >= 1.25 * 0.4
    s.close()


def test_a_holder_hidden_from_proc_counts_as_alive(monkeypatch):
    """With /proc mounted hidepid, another user's live holder has no /proc entry: kill(pid, 0)
    still answers, and only ESRCH means gone."""
    from radixtier.storage.nvmeof import lease as lease_mod

    monkeypatch.setattr(lease_mod, "_pid_start", lambda pid: None)
    assert lease_mod._holder_alive(os.getpid(), 123)
    assert lease_mod._holder_alive(1, 123)  # init: alive (EPERM for a non-root user, else found)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not lease_mod._holder_alive(child.pid, 123)
