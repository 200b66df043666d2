"""The native page core (radixtier/storage/nvmeof/_pagebatch.c, _crc32c.c): the io_uring engine's get/put.

It must be the same store as the Python path, only faster: the same CRC-32C, the same on-device
bytes (a namespace written by one path reads back on the other), the same proof of every page,
and the same rules for pages being read.
"""

from __future__ import annotations

import hashlib
import threading

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixtier.storage.nvmeof.io_engine import uring_unusable_reason
from radixtier.storage.nvmeof.layout import BLOCK
from radixtier.storage.nvmeof.store import NvmeofPageStore

pytestmark = pytest.mark.skipif(bool(uring_unusable_reason()), reason=f"io_uring engine unavailable: "
                                f"{uring_unusable_reason()}")

PAGE = 3 * BLOCK


def key(i: int) -> bytes:
    return hashlib.blake2b(f"n{i}".encode(), digest_size=16).digest()


def content(i: int, nbytes: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=70_000), value=st.integers(0, 2**32 - 1), skip=st.integers(0, 7))
def test_crc32c_matches_the_crc32c_package(data, value, skip):
    from radixtier.storage.nvmeof import _uring

    view = memoryview(data)[skip:]  # every alignment of the start
    assert _uring.crc32c(view, value) == crc32c.crc32c(bytes(view), value=value)


def test_crc32c_over_the_interleaved_block_sizes():
    """Lengths around the 3 x 256 B and 3 x 8 KiB interleaved blocks, where the streams are combined."""
    from radixtier.storage.nvmeof import _uring

    blob = bytes(content(7, 3 * 8192 * 2 + 99).tolist())
    for n in (0, 1, 767, 768, 769, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 3 * 8192 + 768, len(blob)):
        assert _uring.crc32c(blob[:n]) == crc32c.crc32c(blob[:n]), n


@pytest.mark.parametrize("writer,reader", [("threads", "io_uring"), ("io_uring", "threads")])
@pytest.mark.parametrize("direct", [True, False])
def test_a_namespace_written_by_one_path_reads_back_on_the_other(tmp_path, writer, reader, direct):
    path = str(tmp_path / "ns.img")
    n = 12
    pages = [content(i) for i in range(n)]
    s = NvmeofPageStore(path, PAGE, create_bytes=4 << 20, io_engine=writer, direct=direct)
    assert s.io_engine == writer
    parents = [None] + [key(i) for i in range(n - 1)]
    assert all(s.put([key(i) for i in range(n)], pages, parents).ok)
    locs = [s.location(key(i)) for i in range(n)]
    s.close()
    s = NvmeofPageStore(path, PAGE, io_engine=reader, direct=direct, verify="full")
    assert s.recovery["dropped"] == 0  # every slot header and payload proved
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(n)]
    assert s.get([key(i) for i in range(n)], out) == [True] * n
    assert all(torch.equal(a, b) for a, b in zip(out, pages))
    one = torch.zeros(PAGE, dtype=torch.uint8)
    assert s.read_location(locs[5], key(5), one) and torch.equal(one, pages[5])
    assert [s.location(key(i)).checksum for i in range(n)] == [loc.checksum for loc in locs]
    s.close()


def test_both_paths_write_the_same_slot_table_bytes(tmp_path):
    """The native core packs each page's table entry itself: byte for byte layout.TableEntry.pack
    (parents, generations and the entry CRC included), so recovery reads either path's table."""
    tables = []
    for engine in ("threads", "io_uring"):
        path = str(tmp_path / f"{engine}.img")
        s = NvmeofPageStore(path, PAGE, create_bytes=4 << 20, io_engine=engine)
        parents = [None] + [key(i) for i in range(9)]
        assert all(s.put([key(i) for i in range(10)], [content(i) for i in range(10)], parents).ok)
        sb = s.sb
        s.close()
        with open(path, "rb") as f:
            f.seek(sb.table_offset)
            tables.append(f.read(sb.data_offset - sb.table_offset))
    assert tables[0] == tables[1]
    assert tables[0].count(b"\x00") < len(tables[0])  # the entries are there


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_pages_as_flat_segment_lists_round_trip(tmp_path, engine):
    """PageSegments (SGLang's get_page_buffer_meta form: flat address and size lists, K/V of every
    layer of a page) is read and written in place on both paths, aligned (layer chunks of whole
    blocks, O_DIRECT) and not (bounced), and a wrong shape is refused before any I/O."""
    from radixtier.storage.api import PageSegments

    for chunk, name in ((BLOCK, "aligned"), (1000, "unaligned")):
        s = NvmeofPageStore(str(tmp_path / f"{name}.img"), 8 * chunk, create_bytes=4 << 20, io_engine=engine)
        layers, pages = 4, 5  # pool [K/V, layer, page, chunk]: a page is 2 x layers scattered chunks
        src = content(60, 2 * layers * pages * chunk).view(2, layers, pages, chunk)
        addrs = [src[kv, layer, p].data_ptr() for p in range(pages) for layer in range(layers) for kv in range(2)]
        keys = [key(100 + p) for p in range(pages)]
        assert all(s.put(keys, PageSegments(addrs, [chunk] * len(addrs), pages)).ok)
        dst = torch.zeros_like(src)
        daddrs = [dst[kv, layer, p].data_ptr() for p in range(pages) for layer in range(layers) for kv in range(2)]
        assert s.get(keys, PageSegments(daddrs, [chunk] * len(daddrs), pages)) == [True] * pages
        assert torch.equal(dst, src)
        one = torch.zeros(8 * chunk, dtype=torch.uint8)  # the same page as one buffer: the same bytes
        assert s.get([keys[2]], [one]) == [True]
        assert torch.equal(one.view(layers, 2, chunk), src[:, :, 2].transpose(0, 1))
        s.close()
    with pytest.raises(ValueError, match="7 pointers and 7 sizes for 2 pages"):
        PageSegments([1] * 7, [1] * 7, 2)


def test_a_flat_segment_batch_names_a_bad_segment():
    from radixtier.storage.nvmeof import _uring

    with pytest.raises(ValueError, match="do not make pages of 3 segments"):
        _uring.PageBatch([1, 2, 3, 4], True, sizes=[1, 2, 3, 4], per_page=3)
    with pytest.raises(ValueError, match=r"invalid \(address, nbytes\) = \(0, 4096\)"):
        _uring.PageBatch([0, 4096], True, sizes=[4096, 4096], per_page=2)
    with pytest.raises(ValueError, match=r"invalid \(address, nbytes\) = \(0, 4096\)"):  # and as a pair
        _uring.PageBatch([(0, 4096)], True)
    b = _uring.PageBatch([4096, 8192, 12288, 16384], False, sizes=[4096, 100, 4096, 4096], per_page=2)
    assert b.lengths() == [4196, 8192]
    b.close()


def test_every_buffer_shape_round_trips(tmp_path):
    """Aligned tensors (read in place), unaligned ones (bounced), K/V segment lists, raw
    (address, nbytes) pairs, bytearrays and pages shorter than a block."""
    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=4 << 20, io_engine="io_uring")
    short = content(50, 1000)
    k, v = content(51, PAGE // 2), content(52, PAGE // 2)
    raw_src = content(53)
    pages = {key(1): content(1), key(2): content(2)[:]}
    assert all(s.put([key(1), key(2), key(3), key(4), key(5)],
                     [pages[key(1)], bytearray(pages[key(2)].numpy().tobytes()), short, [k, v],
                      (raw_src.data_ptr(), PAGE)]).ok)
    unaligned = torch.zeros(PAGE + 1, dtype=torch.uint8)[1:]
    seg_out = [torch.zeros(PAGE // 2, dtype=torch.uint8), torch.zeros(PAGE // 2, dtype=torch.uint8)]
    raw_out = torch.zeros(PAGE, dtype=torch.uint8)
    short_out = bytearray(1000)
    plain = torch.zeros(PAGE, dtype=torch.uint8)
    assert s.get([key(1), key(2), key(3), key(4), key(5)],
                 [unaligned, plain, short_out, seg_out, (raw_out.data_ptr(), PAGE)]) == [True] * 5
    assert torch.equal(unaligned, pages[key(1)]) and torch.equal(plain, pages[key(2)])
    assert bytes(short_out) == bytes(short.numpy().tobytes())
    assert torch.equal(seg_out[0], k) and torch.equal(seg_out[1], v) and torch.equal(raw_out, raw_src)
    with pytest.raises(ValueError, match="read-only"):
        s.get([key(1)], [bytes(PAGE)])
    with pytest.raises(ValueError, match="has 10 bytes, the stored page has"):
        s.get([key(1)], [bytearray(10)])
    assert s.delete([key(1)]) == 1  # no page was left marked as being read
    s.close()


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_page_being_read_is_never_the_victim(tmp_path, monkeypatch, engine):
    """While a read is in flight, a full store evicts other pages; the one being read stays."""
    cap = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=4 << 20, io_engine=engine)
    slots = cap.num_free
    keys = [key(i) for i in range(slots)]
    assert all(cap.put(keys, [content(i % 7) for i in range(slots)]).ok)
    reading = keys[0]  # the least recently used page: the first victim, were it not being read
    name = "read_pages" if cap._engine.native_pages else "run"
    real = getattr(cap._engine, name)
    inside, release = threading.Event(), threading.Event()

    def held(*args):
        inside.set()
        assert release.wait(10)
        return real(*args)

    monkeypatch.setattr(cap._engine, name, held)
    out = torch.zeros(PAGE, dtype=torch.uint8)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("ok", cap.get([reading], [out])))
    t.start()
    assert inside.wait(10)
    monkeypatch.setattr(cap._engine, name, real)
    new = [key(10_000 + i) for i in range(4)]
    res = cap.put(new, [content(i) for i in range(4)])
    assert all(res.ok) and reading not in res.evicted and len(res.evicted) == 4
    release.set()
    t.join(10)
    assert result["ok"] == [True] and torch.equal(out, content(0))
    cap.close()


def test_reads_count_as_use_for_eviction(tmp_path):
    """Reads reach the eviction order lazily, but before any victim is chosen."""
    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=4 << 20, io_engine="io_uring")
    slots = s.num_free
    keys = [key(i) for i in range(slots)]
    assert all(s.put(keys, [content(1)] * slots).ok)
    assert s.get([keys[0]], [torch.zeros(PAGE, dtype=torch.uint8)]) == [True]
    res = s.put([key(99_999)], [content(2)])
    assert res.evicted == [keys[1]]  # keys[0] was read after keys[1] was written
    s.close()


@pytest.mark.parametrize("direct", [True, False])
def test_large_pages_of_many_segments_round_trip_and_stay_proven(tmp_path, direct):
    """5 MiB pages of 64 segments (SGLang's layer_first shape): written by the native core, read
    back by both paths (in place and bounced), and a flipped byte near the end fails the proof."""
    page = 5 * (1 << 20) + 3 * BLOCK
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, page, create_bytes=340 << 20, io_engine="io_uring", direct=direct)
    n = 4
    pages = [content(i, page) for i in range(n)]
    segs = [[p[j * (page // 64):(j + 1) * (page // 64)] for j in range(64)] for p in pages]  # layer_first-like
    assert all(s.put([key(i) for i in range(n)], segs).ok)
    out = [torch.zeros(page, dtype=torch.uint8) for _ in range(n)]
    assert s.get([key(i) for i in range(n)], out) == [True] * n
    assert all(torch.equal(a, b) for a, b in zip(out, pages))
    unaligned = [torch.zeros(page + 1, dtype=torch.uint8)[1:] for _ in range(n)]
    assert s.get([key(i) for i in range(n)], unaligned) == [True] * n  # bounced
    assert all(torch.equal(a, b) for a, b in zip(unaligned, pages))
    loc = s.location(key(2))
    s.close()
    t = NvmeofPageStore(path, page, io_engine="threads", direct=direct)
    back = [torch.zeros(page, dtype=torch.uint8) for _ in range(n)]
    assert t.get([key(i) for i in range(n)], back) == [True] * n and torch.equal(back[3], pages[3])
    t.close()
    with open(path, "r+b") as f:
        f.seek(s.sb.slot_offset(loc.slot) + BLOCK + page - 100)  # in the page's last segment
        c = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([c[0] ^ 0x80]))
    s = NvmeofPageStore(path, page, io_engine="io_uring", direct=direct)
    assert s.get([key(i) for i in range(n)], out) == [True, True, False, True]
    assert s.counters.corrupt_checksum == 1
    s.close()


def test_a_read_the_ring_never_ran_is_a_miss_and_keeps_the_page(tmp_path, monkeypatch):
    """Status 4 (the I/O ring failed before the read ran) proves nothing bad about the page: it is
    a miss, counted as an I/O error, and the page stays indexed for the next read."""
    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=4 << 20, io_engine="io_uring")
    assert all(s.put([key(1), key(2)], [content(1), content(2)]).ok)
    real = s._engine.read_pages
    monkeypatch.setattr(s._engine, "read_pages", lambda batch, fd, d, sb, u, keys, slots, held, c, direct:
                        (b"\x00" + b"\x04" * (len(keys) - 1), 11))
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(2)]
    assert s.get([key(1), key(2)], out) == [True, False]
    assert s.counters.io_errors == 1 and s.counters.corrupt == 0 and s.exists([key(2)]) == [True]
    monkeypatch.setattr(s._engine, "read_pages", real)
    assert s.get([key(2)], out[1:]) == [True] and torch.equal(out[1], content(2))
    s.close()


def test_a_page_two_reads_hold_stays_held_until_both_end():
    """Pages in read are kept per read: one read ending must not free a page another still reads."""
    from radixtier.eviction import EvictionOrder

    r = EvictionOrder()
    for k in (key(1), key(2), key(3)):
        r.add(k)
    a = r.pin_batch([key(1), key(2)])
    b = r.pin_batch([key(2), key(3)])
    r.unpin_batch(a)
    assert not r.is_pinned(key(1)) and r.is_pinned(key(2)) and r.is_pinned(key(3))
    assert r.next_victim() == key(1)
    r.unpin_batch(b)
    assert not r.is_pinned(key(2)) and r.batch_pins() == 0


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_read_that_fails_midway_leaves_no_page_marked_as_being_read(tmp_path, monkeypatch, engine):
    """A failed read must end its registration: else its pages could never be evicted or deleted."""
    s = NvmeofPageStore(str(tmp_path / "ns.img"), PAGE, create_bytes=4 << 20, io_engine=engine)
    assert all(s.put([key(1), key(2)], [content(1), content(2)]).ok)
    name = "read_pages" if s._engine.native_pages else "run"

    def broken(*args):
        raise OSError(5, "injected")

    monkeypatch.setattr(s._engine, name, broken)
    with pytest.raises(OSError):
        s.get([key(1), key(2)], [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(2)])
    monkeypatch.undo()
    assert s.delete([key(1), key(2)]) == 2  # neither page was left marked as being read
    s.close()


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_a_read_of_present_missing_and_corrupt_pages_answers_each_in_its_place(tmp_path, engine):
    """Misses are left out of the device read and the pages read are mapped back to the caller's
    order: each answer lands at its own index, a corrupt page is a miss (and dropped), and the
    bytes of every proven page are its own."""
    path = str(tmp_path / "ns.img")
    s = NvmeofPageStore(path, PAGE, create_bytes=4 << 20, io_engine=engine)
    assert all(s.put([key(i) for i in (1, 3, 4, 6)], [content(i) for i in (1, 3, 4, 6)]).ok)
    loc = s.location(key(4))
    with open(path, "r+b") as f:  # flip a payload byte of page 4
        f.seek(s.sb.slot_offset(loc.slot) + BLOCK + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    asked = [0, 1, 2, 3, 4, 5, 6]
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in asked]
    assert s.get([key(i) for i in asked], out) == [False, True, False, True, False, False, True]
    for i in (1, 3, 6):
        assert torch.equal(out[asked.index(i)], content(i))
    assert s.exists([key(4)]) == [False] and s.counters.corrupt_checksum == 1 and s.counters.misses == 3
    s.close()


def test_the_native_core_is_refused_when_its_constants_are_not_pythons():
    """Format constants and status codes have one definition each in Python (layout.NATIVE_LAYOUT,
    status.PageStatus); the C build exports what it was compiled with and a mismatch is refused."""
    import types

    from radixtier.storage.nvmeof.io_engine import native_mismatch
    from radixtier.storage.nvmeof.layout import NATIVE_LAYOUT
    from radixtier.storage.nvmeof.status import PageStatus

    statuses = {s.name: s.value for s in PageStatus}
    assert native_mismatch(types.SimpleNamespace(LAYOUT=dict(NATIVE_LAYOUT), STATUS=dict(statuses))) == ""
    assert "ENTRY_BODY" in native_mismatch(types.SimpleNamespace(LAYOUT={**NATIVE_LAYOUT, "ENTRY_BODY": 56},
                                                                 STATUS=statuses))
    assert "STALE" in native_mismatch(types.SimpleNamespace(LAYOUT=NATIVE_LAYOUT, STATUS={**statuses, "STALE": 6}))
    assert "LAYOUT" in native_mismatch(types.SimpleNamespace())  # a build older than the exported dicts
    try:
        from radixtier.storage.nvmeof import _uring
    except ImportError:
        pytest.skip("the io_uring extension is not built here")
    assert native_mismatch(_uring) == ""  # this build agrees
