"""Page pools: slot accounting, clear errors, and host pages O_DIRECT can read into."""

import resource

import numpy as np
import pytest
import torch

from radixtier import pools as pools_module
from radixtier.pools import HOST_ALIGN, PagePool, PoolExhausted, resolve_device

NATIVE = pools_module._native_free


@pytest.fixture(params=["native", "numpy"], autouse=True)
def free_path(request, monkeypatch):
    """Every test runs on both ways free() can be done: the C pass and the numpy fallback."""
    if request.param == "native" and NATIVE is None:
        pytest.skip("radixtier._slotpool was not built (no C compiler at install): numpy path only")
    monkeypatch.setattr(pools_module, "_native_free", NATIVE if request.param == "native" else None)
    return request.param


def pool(n=4, shape=(1000,)):
    return PagePool("host", n, shape, torch.float16, torch.device("cpu"))


def test_out_of_slots_says_how_many_are_free():
    p = pool()
    got = p.alloc(3)
    with pytest.raises(PoolExhausted, match="host pool: need 2 free page slots, 1 of 4 free"):
        p.alloc(2)
    assert p.try_alloc(2) is None and p.num_free == 1  # a failed allocation takes nothing
    p.free(got)
    assert sorted(p.alloc(4)) == [0, 1, 2, 3]


def test_double_free_and_foreign_slot_are_errors():
    p = pool()
    s = p.alloc(1)
    p.free(s)
    with pytest.raises(RuntimeError, match="double free of slot"):
        p.free(s)
    with pytest.raises(ValueError, match="out of range"):
        p.free([4])
    with pytest.raises(ValueError, match="slot -1 out of range"):
        p.free([-1])
    both = p.alloc(2)
    with pytest.raises(RuntimeError, match="given twice"):
        p.free([both[0], both[1], both[0]])  # pushed twice, it would later go to two owners
    assert p.num_free == 2  # nothing was freed
    p.free(both)
    assert sorted(p.alloc(4).tolist()) == [0, 1, 2, 3]  # every slot exactly once


def test_host_pages_start_on_4k_boundaries():
    p = pool(8, (1000,))  # 2000-byte pages: the pool itself must start aligned
    assert p.buffer.data_ptr() % HOST_ALIGN == 0
    p2 = pool(3, (2048,))  # 4 KiB pages: every page is aligned
    assert all(p2.page(i).data_ptr() % HOST_ALIGN == 0 for i in range(3))


def test_write_read_round_trip_and_shape_errors():
    p = pool()
    pages = torch.randn(2, 1000).half()
    slots = p.alloc(2)
    p.write(slots, pages)
    assert torch.equal(p.read(slots), pages)
    with pytest.raises(ValueError, match="expected pages of shape"):
        p.write(slots, torch.zeros(2, 999).half())


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_bad_sizes_name_the_field(bad):
    with pytest.raises(ValueError, match="host_pages: expected a positive integer"):
        PagePool("host", bad, (8,), torch.float16, torch.device("cpu"))


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present on this machine: the error cannot occur")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_runs_freed_together_are_all_or_nothing():
    p = pool(8, (4,))
    a, b = p.alloc(3), p.alloc(3)
    with pytest.raises(RuntimeError, match="host pool: double free of slot"):
        p.free_runs([a, np.array([b[0], 7])])  # slot 7 was never handed out
    assert p.num_free == 2  # nothing was freed, the first run included
    with pytest.raises(RuntimeError, match="given twice"):
        p.free_runs([a, b[:1], a[1:2]])
    assert p.num_free == 2
    many = [np.array([s]) for s in np.concatenate([a, b])]  # one run per slot
    p.free_runs(many)
    assert sorted(p.alloc(8).tolist()) == list(range(8))  # every slot exactly once


def test_freeing_a_large_pool_does_not_fault_in_memory_page_by_page():
    """A pool's bookkeeping arrays are written in full when the pool is made: a lazily mapped one
    faulted a fresh 4 KiB page on the first write of each free(), 25-35 us of a 2,048-slot free."""
    p = PagePool("device", 1 << 20, (1,), torch.int8, torch.device("cpu"))
    taken = [p.alloc(4096) for _ in range(256)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for slots in taken:
        p.free(slots)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, f"{faults} page faults freeing 256 x 4,096 slots"


def test_odd_runs_get_the_same_answer_on_both_paths():
    p = pool(8, (4,))
    a = p.alloc(4)
    p.free_runs([])  # nothing to free: no error, nothing changes
    assert p.num_free == 4
    with pytest.raises(TypeError, match="host pool: .*int64"):
        p.free_runs([a.astype(np.int32)])
    assert p.num_free == 4
    wide = np.empty(8, dtype=np.int64)
    wide[::2] = a  # a strided view: refused, as free() would make it contiguous first
    with pytest.raises(TypeError, match="host pool: .*contiguous int64"):
        p.free_runs([a[:2], wide[::2]])
    assert p.num_free == 4
    p.free(wide[::2])
    assert p.num_free == 8
