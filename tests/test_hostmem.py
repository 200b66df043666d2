"""Host memory that tier-3 pages land in: zeroed, aligned for O_DIRECT, and on transparent huge
pages where the kernel offers them (reads into 4 KiB-page memory ran 15-18% slower here)."""

import re

import pytest
import torch

from radixtier.hostmem import HUGE_PAGE_BYTES, host_memory
from radixtier.pools import PagePool

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str:
    try:
        with open(THP) as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "absent"


def _huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_host_memory_is_zeroed_writable_and_aligned_for_direct_io():
    t = host_memory(3 * HUGE_PAGE_BYTES + 12345)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE_BYTES + 12345
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(t.count_nonzero()) == 0
    t[-1] = 7
    assert int(t[-1]) == 7
    small = host_memory(100)
    assert small.numel() == 100 and small.data_ptr() % 4096 == 0


@pytest.mark.parametrize("bad", [0, -1])
def test_host_memory_refuses_a_non_positive_size(bad):
    with pytest.raises(ValueError, match="nbytes"):
        host_memory(bad)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {_thp_mode()} on this kernel")
def test_host_memory_is_backed_by_huge_pages():
    t = host_memory(8 * HUGE_PAGE_BYTES)
    assert _huge_kib_at(t.data_ptr()) >= HUGE_PAGE_BYTES // 1024


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {_thp_mode()} on this kernel")
def test_an_unpinned_host_pool_is_backed_by_huge_pages():
    pool = PagePool("host", 64, (2, 4, 16384), torch.float16, torch.device("cpu"))
    assert pool.buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert _huge_kib_at(pool.buffer.data_ptr()) >= HUGE_PAGE_BYTES // 1024


def test_host_memory_works_in_a_process_forked_after_torch_ran_in_parallel():
    """Serving ranks and bench readers are forked: torch's parallel fill hangs there (it did)."""
    import multiprocessing as mp

    parent = host_memory(64 * HUGE_PAGE_BYTES)
    parent.add_(1)  # the parent's intra-op thread pool is up
    ctx = mp.get_context("fork")
    answers = ctx.Queue()

    def child(q):
        t = host_memory(16 * HUGE_PAGE_BYTES)
        q.put((t.data_ptr() % HUGE_PAGE_BYTES, bytes(t[:16].numpy()), bytes(t[-16:].numpy())))

    p = ctx.Process(target=child, args=(answers,), daemon=True)
    p.start()
    try:
        assert answers.get(timeout=60) == (0, bytes(16), bytes(16))
    finally:
        p.kill()
        p.join()
