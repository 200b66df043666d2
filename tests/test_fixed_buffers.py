"""Reads into registered host memory (io_uring fixed buffers): same bytes, same proof, less pinning.

A host pool registered with NvmeofPageStore.register_memory is pinned by the kernel once (each
reading thread's io_uring clones the registration, or registers it itself on older kernels);
page segments of at least 256 KiB inside it are then read with READ_FIXED (no per-I/O pinning of
their 4 KiB pages). These tests pin down that the path is taken where it should be (fixed_ios
counts its I/Os), that it returns the stored bytes and still proves every page, and that a
refused registration changes nothing but the speed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import threading
import time

import pytest
import torch

from radixtier.hostmem import host_memory
from radixtier.storage.api import PageSegments
from radixtier.storage.nvmeof.io_engine import uring_unusable_reason
from radixtier.storage.nvmeof.layout import BLOCK
from radixtier.storage.nvmeof.store import NvmeofPageStore

needs_uring = pytest.mark.skipif(bool(uring_unusable_reason()), reason=f"io_uring engine unavailable: "
                                 f"{uring_unusable_reason()}")

SEG = 256 << 10  # a K or V segment of a page_first_direct page (at the fixed-buffer minimum)
N = 6


def key(i: int) -> bytes:
    return hashlib.blake2b(f"f{i}".encode(), digest_size=16).digest()


class Pool:
    """A page_first_direct-like host pool: K of page i at k[i], V at v[i], `seg` bytes each."""

    def __init__(self, n: int, seg: int = SEG) -> None:
        self.mem = host_memory(2 * n * seg)
        self.k, self.v = self.mem[:n * seg].view(n, seg), self.mem[n * seg:].view(n, seg)
        self.n, self.seg = n, seg

    def region(self):
        return [(self.mem.data_ptr(), self.mem.numel())]

    def pages(self, idx) -> PageSegments:
        addrs, sizes = [], []
        for i in idx:
            addrs += [self.k[i].data_ptr(), self.v[i].data_ptr()]
            sizes += [self.seg, self.seg]
        return PageSegments(addrs, sizes, len(idx))

    def fill(self, seed: int) -> None:
        self.mem.copy_(torch.randint(0, 256, (self.mem.numel(),), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed)))


def open_store(tmp_path, seg: int = SEG, engine: str = "io_uring") -> NvmeofPageStore:
    s = NvmeofPageStore(str(tmp_path / "ns.img"), 2 * seg, create_bytes=64 << 20, io_engine=engine)
    if engine == "io_uring" and not s.direct:
        s.close()
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT, and fixed buffers serve direct reads only")
    return s


def register(s: NvmeofPageStore, pool: "Pool") -> None:
    """Register the pool; without CAP_IPC_LOCK a small RLIMIT_MEMLOCK may refuse it (a skip, with why)."""
    if not s.register_memory(pool.region()):
        if os.geteuid() != 0:
            pytest.skip(f"the kernel refused to pin {pool.mem.numel() >> 20} MiB "
                        f"(RLIMIT_MEMLOCK {resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]}, not root)")
        pytest.fail("register_memory refused as root")


def stored(tmp_path, seed: int, n: int = N, seg: int = SEG):
    """A store holding pages 0..n-1 written from a filled pool, the pool registered and zeroed
    again: (store, pool, the bytes the pool must hold after reading every page back)."""
    s, pool = open_store(tmp_path, seg=seg), Pool(n, seg=seg)
    pool.fill(seed)
    want = pool.mem.clone()
    assert all(s.put([key(i) for i in range(n)], pool.pages(range(n))).ok)
    register(s, pool)
    pool.mem.zero_()
    return s, pool, want


@needs_uring
def test_pages_in_registered_memory_are_read_on_fixed_buffers_byte_exact(tmp_path):
    s, pool, want = stored(tmp_path, 1)
    assert s.get([key(i) for i in range(N)], pool.pages(range(N))) == [True] * N
    assert torch.equal(pool.mem, want)
    assert s.stats()["fixed_ios"] == 2 * N  # one READ_FIXED per segment; the headers are plain reads
    s.close()


@needs_uring
def test_a_batch_mixing_registered_and_other_memory_reads_each_page_its_own_way(tmp_path):
    s, pool, other = open_store(tmp_path), Pool(N), Pool(N)
    pool.fill(2)
    want = pool.mem.clone()
    assert all(s.put([key(i) for i in range(N)], pool.pages(range(N))).ok)
    register(s, pool)
    pool.mem.zero_()
    # even pages land in the registered pool, odd ones in memory the ring never registered
    addrs, sizes = [], []
    for i in range(N):
        dst = pool if i % 2 == 0 else other
        addrs += [dst.k[i].data_ptr(), dst.v[i].data_ptr()]
        sizes += [SEG, SEG]
    assert s.get([key(i) for i in range(N)], PageSegments(addrs, sizes, N)) == [True] * N
    for i in range(N):
        dst = pool if i % 2 == 0 else other
        assert torch.equal(dst.k[i], want[:N * SEG].view(N, SEG)[i])
        assert torch.equal(dst.v[i], want[N * SEG:].view(N, SEG)[i])
    assert s.stats()["fixed_ios"] == N  # 2 segments x the 3 even pages
    s.close()


@needs_uring
def test_a_corrupt_page_read_on_fixed_buffers_fails_its_proof(tmp_path):
    s, pool = open_store(tmp_path), Pool(N)
    pool.fill(3)
    assert all(s.put([key(i) for i in range(N)], pool.pages(range(N))).ok)
    loc = s.location(key(2))
    with open(s.path, "r+b") as f:  # flip a byte in page 2's V segment
        f.seek(s.sb.slot_offset(loc.slot) + BLOCK + SEG + 1000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    register(s, pool)
    ok = s.get([key(i) for i in range(N)], pool.pages(range(N)))
    assert ok == [True, True, False, True, True, True]
    assert s.counters.corrupt_checksum == 1 and s.stats()["fixed_ios"] == 2 * N
    s.close()


@needs_uring
def test_small_segments_stay_in_one_vectored_read(tmp_path):
    """Below 256 KiB a segment is not worth an I/O of its own: the page goes as one readv."""
    s, pool, want = stored(tmp_path, 4, seg=64 << 10)
    assert s.get([key(i) for i in range(N)], pool.pages(range(N))) == [True] * N
    assert torch.equal(pool.mem, want) and s.stats()["fixed_ios"] == 0
    s.close()


@needs_uring
def test_every_thread_registers_before_its_first_read(tmp_path):
    """Rings are per thread: a thread that first reads after register_memory registers then."""
    s, pool, want = stored(tmp_path, 5)
    got = []
    t = threading.Thread(target=lambda: got.append(s.get([key(i) for i in range(N)], pool.pages(range(N)))))
    t.start()
    t.join()
    assert got == [[True] * N] and torch.equal(pool.mem, want) and s.stats()["fixed_ios"] == 2 * N
    s.close()


@needs_uring
def test_a_refused_registration_is_logged_once_and_reads_go_on(tmp_path, caplog):
    s, pool = open_store(tmp_path), Pool(N)
    pool.fill(6)
    want = pool.mem.clone()
    assert all(s.put([key(i) for i in range(N)], pool.pages(range(N))).ok)
    unmapped = [(BLOCK, 1 << 20)]  # the kernel cannot pin the first pages of the address space
    with caplog.at_level(logging.WARNING, logger="radixtier.storage.io"):
        assert s.register_memory(unmapped) is False
        assert s.register_memory(pool.region()) is False  # not retried: the first refusal stands
    assert sum("refused to register" in r.message for r in caplog.records) == 1
    pool.mem.zero_()
    assert s.get([key(i) for i in range(N)], pool.pages(range(N))) == [True] * N
    assert torch.equal(pool.mem, want) and s.stats()["fixed_ios"] == 0
    s.close()


def test_a_bad_region_names_itself(tmp_path):
    s = open_store(tmp_path, engine="threads")
    with pytest.raises(ValueError, match=r"regions\[0\]: address"):
        s.register_memory([(0, 4096)])
    with pytest.raises(ValueError, match=r"regions\[1\] nbytes"):
        s.register_memory([(4096, 4096), (8192, 0)])
    assert s.register_memory([(4096, 4096)]) is False  # the thread pool has nothing to register
    s.close()


def test_regions_are_cut_into_pieces_the_kernel_registers():
    from radixtier.storage.nvmeof.io_engine import fixed_chunks

    gib = 1 << 30
    assert fixed_chunks([(4096, 2 * gib + 8192), (1 << 40, 4096)]) == [
        (4096, gib), (4096 + gib, gib), (4096 + 2 * gib, 8192), (1 << 40, 4096)]


@needs_uring
def test_the_embedded_cache_reads_tier_3_into_its_registered_host_pool(ns4, ns_file):
    """TieredKVCache registers its host pool with the store: 256 KiB pages come back from tier 3 on
    fixed buffers, byte-exact; closing the cache takes the pool back from the store."""
    from radixtier.testing.pages import page_content
    from radixtier.cache import CacheConfig, TieredKVCache
    from radixtier.hashing import PageHasher

    numel = SEG // 4
    store = NvmeofPageStore(ns_file, SEG, create_bytes=64 << 20)

    def cache():
        return TieredKVCache(CacheConfig(page_size=4, page_shape=(numel,), dtype=torch.int32, device_pages=16,
                                         host_pages=32, device="cpu"), ns4, store=store)

    tokens = list(range(32))
    keys = PageHasher(ns4).chain(tokens)
    c = cache()
    c.insert(tokens, torch.stack([page_content(k, numel) for k in keys]))
    c.close()  # flushed to tier 3
    assert store.stats()["fixed_ios"] == 0  # writes never use fixed buffers
    c = cache()  # empty L1/L2: the prefix comes back from tier 3
    with c.prefetch(tokens) as h:
        r = h.load("wait_complete")
        assert r.num_pages == 8
        got = c.gather(r.device_slots)
        assert all(torch.equal(got[i], page_content(k, numel)) for i, k in enumerate(keys))
    assert store.stats()["fixed_ios"] == 8
    c.close()
    pool_page = c.host_pool.page(0)  # still mapped (c holds it), but no longer registered
    assert store.get([keys[0]], [pool_page]) == [True] and store.stats()["fixed_ios"] == 8
    assert torch.equal(pool_page, page_content(keys[0], numel))
    store.close()


@needs_uring
def test_a_cache_closed_after_its_store_gives_its_pool_back_quietly(tmp_path):
    s, pool = open_store(tmp_path), Pool(2)
    register(s, pool)
    s.close()
    assert s.register_memory([]) is False  # what TieredKVCache.close() does: no error once closed


@needs_uring
@pytest.mark.parametrize("clone", [True, False])
def test_reading_threads_take_the_registration_by_clone_or_by_pinning_it_themselves(tmp_path, clone):
    """Each reading thread's ring gets the registered memory before its first read: by cloning the
    engine's registry ring (Linux 6.12+, no second pinning) or, where the kernel cannot clone, by
    registering it itself. Either way the reads are on fixed buffers and byte-exact."""
    s, pool = open_store(tmp_path), Pool(N)
    pool.fill(7)
    want = pool.mem.clone()
    assert all(s.put([key(i) for i in range(N)], pool.pages(range(N))).ok)
    s._engine._clone_ok = clone  # as on a kernel without IORING_REGISTER_CLONE_BUFFERS when False
    register(s, pool)
    results = []

    def read(lo: int, hi: int) -> None:
        results.append(s.get([key(i) for i in range(lo, hi)], pool.pages(range(lo, hi))))

    pool.mem.zero_()
    threads = [threading.Thread(target=read, args=(i, i + 2)) for i in range(0, N, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[True, True]] * (N // 2) and torch.equal(pool.mem, want)
    assert s.stats()["fixed_ios"] == 2 * N
    s.close()


def _pinned_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmPin:"))


@needs_uring
def test_giving_the_memory_back_unpins_it_once_its_reading_threads_are_gone(tmp_path):
    """register_memory([]) closes the rings of threads that have finished (nothing else would, until
    the store closes) and drops the caller's: the kernel's pin on the pool goes (VmPin), and the
    finished threads' fixed I/Os stay counted."""
    s, pool = open_store(tmp_path), Pool(N)
    pool.fill(8)
    assert all(s.put([key(i) for i in range(N)], pool.pages(range(N))).ok)
    base = _pinned_kib()
    register(s, pool)
    t = threading.Thread(target=lambda: s.get([key(i) for i in range(N)], pool.pages(range(N))))
    t.start()
    t.join()
    assert _pinned_kib() - base >= pool.mem.numel() >> 10
    assert s.register_memory([]) is False
    deadline = time.monotonic() + 5
    while _pinned_kib() > base and time.monotonic() < deadline:  # ring teardown is asynchronous
        time.sleep(0.01)
    assert _pinned_kib() == base and s.stats()["fixed_ios"] == 2 * N
    s.close()
