"""PageMover: the cache's mover -- page copies between tiers (spill, promote, tier-3 I/O) on background workers.

Mechanism only: the cache decides what moves; this module moves bytes and reports per-page
success through futures. Device copies run on a dedicated CUDA stream per worker when CUDA
is present; tier-3 I/O goes through the store, which parallelises it further.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from radixtier.metrics import DIRECTIONS, CacheStats
from radixtier.pools import PagePool
from radixtier.storage.api import PageLocation, PageStore, PutResult


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both slot lists advance by one together."""
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    if s.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist()))


def copy_pages(src: PagePool, src_slots: Sequence[int], dst: PagePool, dst_slots: Sequence[int],
               stream: Optional["torch.cuda.Stream"] = None, ready: Optional["torch.cuda.Event"] = None) -> None:
    """Copy pages slot-to-slot; coalesces contiguous runs into single tensor copies.

    `ready` is an event recorded on the submitting thread's stream: a worker's own current
    stream is not the one the serving thread queued its KV writes on.
    """
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"copy_pages: {len(src_slots)} source slots but {len(dst_slots)} destination slots")
    runs = contiguous_runs(src_slots, dst_slots)
    if stream is None:
        for s, d, n in runs:
            dst.buffer[d:d + n].copy_(src.buffer[s:s + n])
        return
    # The copy must see every kernel the serving stream queued that wrote the source pages.
    if ready is not None:
        stream.wait_event(ready)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for s, d, n in runs:
            dst.buffer[d:d + n].copy_(src.buffer[s:s + n], non_blocking=True)
    stream.synchronize()


class PageMover:
    """Background page movers: device<->host copies and host<->store I/O, each returning a Future."""

    def __init__(self, device_pool: PagePool, host_pool: PagePool, store: Optional[PageStore],
                 stats: CacheStats, io_workers: int = 4, copy_workers: int = 1) -> None:
        if io_workers <= 0:
            raise ValueError(f"io_workers: expected a positive integer, got {io_workers!r}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.store = store
        self.stats = stats
        self._use_cuda = device_pool.device.type == "cuda"
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self._copy = ThreadPoolExecutor(max_workers=copy_workers, thread_name_prefix="radixtier-copy")
        self._io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="radixtier-io")
        self._depth_lock = threading.Lock()
        self._depths: Dict[str, int] = {d: 0 for d in DIRECTIONS}
        self._closed = False

    # -- public ops --------------------------------------------------------------------
    def device_to_host(self, dev_slots: Sequence[int], host_slots: Sequence[int]) -> Future:
        ready = self._caller_ready()
        return self._submit(self._copy, "device_to_host", len(dev_slots), self.device_pool.page_bytes,
                            lambda: self._copy_pages(self.device_pool, dev_slots, self.host_pool, host_slots, ready))

    def host_to_device(self, host_slots: Sequence[int], dev_slots: Sequence[int]) -> Future:
        ready = self._caller_ready()
        return self._submit(self._copy, "host_to_device", len(host_slots), self.device_pool.page_bytes,
                            lambda: self._copy_pages(self.host_pool, host_slots, self.device_pool, dev_slots, ready))

    def host_to_storage(self, host_slots: Sequence[int], keys: Sequence[bytes],
                        parents: Sequence[Optional[bytes]]) -> Future:
        store = self._need_store()
        return self._submit(self._io, "host_to_storage", None, self.host_pool.page_bytes,
                            lambda: store.put(keys, [self.host_pool.page(s) for s in host_slots], parents))

    def pages_to_storage(self, pages: torch.Tensor, keys: Sequence[bytes],
                         parents: Sequence[Optional[bytes]]) -> Future:
        """Write staged pages ([n, *page_shape] on the CPU, e.g. an evicted node's copy) to tier 3."""
        store = self._need_store()
        return self._submit(self._io, "host_to_storage", None, self.host_pool.page_bytes,
                            lambda: store.put(keys, [pages[i] for i in range(len(keys))], parents))

    def storage_to_host(self, keys: Sequence[bytes], host_slots: Sequence[int]) -> Future:
        store = self._need_store()
        return self._submit(self._io, "storage_to_host", None, self.host_pool.page_bytes,
                            lambda: store.get(keys, [self.host_pool.page(s) for s in host_slots]))

    def remote_to_host(self, locations: Sequence[PageLocation], keys: Sequence[bytes],
                       host_slots: Sequence[int]) -> Future:
        store = self._need_store()
        return self._submit(self._io, "remote_to_host", None, self.host_pool.page_bytes,
                            lambda: store.read_locations(locations, keys, [self.host_pool.page(s) for s in host_slots]))

    def copy_now(self, src: PagePool, src_slots: Sequence[int], dst: PagePool, dst_slots: Sequence[int]) -> None:
        """Synchronous copy for the rare inline spill (no free slot and no clean victim)."""
        direction = "device_to_host" if src is self.device_pool else "host_to_device"
        self._copy_pages(src, src_slots, dst, dst_slots)
        self.stats.record_move(direction, len(src_slots), len(src_slots) * src.page_bytes)

    def queue_depths(self) -> Dict[str, int]:
        with self._depth_lock:
            return dict(self._depths)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._copy.shutdown(wait=True)
        self._io.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------
    def _need_store(self) -> PageStore:
        if self.store is None:
            raise RuntimeError("no tier-3 store is configured")
        return self.store

    def _stream(self) -> Optional["torch.cuda.Stream"]:
        if not self._use_cuda:
            return None
        tid = threading.get_ident()
        s = self._streams.get(tid)
        if s is None:
            s = torch.cuda.Stream(device=self.device_pool.device)
            self._streams[tid] = s
        return s

    def _caller_ready(self) -> Optional["torch.cuda.Event"]:
        """An event on the calling (serving) thread's stream, for a worker's copy to wait on."""
        if not self._use_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device_pool.device))
        return ev

    def _copy_pages(self, src: PagePool, src_slots, dst: PagePool, dst_slots,
                    ready: Optional["torch.cuda.Event"] = None) -> None:
        copy_pages(src, src_slots, dst, dst_slots, self._stream(), ready)

    def _submit(self, pool: ThreadPoolExecutor, direction: str, pages: Optional[int], page_bytes: int,
                fn: Callable[[], object]) -> Future:
        with self._depth_lock:
            self._depths[direction] += 1

        def run() -> object:
            try:
                result = fn()
            except BaseException:
                self.stats.record_failure(direction)
                raise
            finally:
                with self._depth_lock:
                    self._depths[direction] -= 1
            ok = _count_ok(result) if pages is None else pages
            self.stats.record_move(direction, ok, ok * page_bytes)
            return result

        return pool.submit(run)


def _count_ok(result: object) -> int:
    if isinstance(result, PutResult):
        return sum(result.ok)
    if isinstance(result, list):
        return sum(bool(x) for x in result)
    return 0
