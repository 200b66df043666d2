"""The baseline tier-3 of the field: one file per page, read serially, like SGLang's HiCacheFile
or LMCache's local disk backend before its parallel-read patch.

It speaks radixtier's PageStore interface so the TTFT benchmark can put it under the same
device and host tiers as radixtier's store: only the tier-3 software differs. One reader and
one writer at a time (HiCacheFile has one prefetch and one backup thread); written pages are
synced and dropped from the page cache, so reads come from the disk as they do once the KV
working set is larger than DRAM.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from radixtier.eviction import LEAVES_FIRST, EvictionOrder
from radixtier.storage.api import BufferLike, PageLocation, PutResult, TaggedPage, buffer_view


class OneFilePerPageStore:
    """PageStore over a directory: `<key hex>.bin` per page, buffered I/O, no checksums."""

    def __init__(self, directory: str, page_bytes: int, capacity_pages: int, eviction: str = LEAVES_FIRST) -> None:
        if page_bytes <= 0 or capacity_pages <= 0:
            raise ValueError(f"page_bytes and capacity_pages must be positive, got {page_bytes}, {capacity_pages}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_pages
        self.partition = 0  # one writer: the whole directory
        self.uuid = hashlib.blake2b(os.path.abspath(directory).encode(), digest_size=16).hexdigest()
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._pages: Dict[bytes, Tuple[int, Optional[bytes]]] = {}  # key -> (length, parent)
        self._order = EvictionOrder(eviction)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + ".bin")

    def router_tags(self, batch_pages: int = 256) -> Iterator[List[TaggedPage]]:
        """This baseline keeps no router tags: nothing to name."""
        return iter(())

    def put(self, keys: Sequence[bytes], buffers: Sequence[BufferLike],
            parents: Optional[Sequence[Optional[bytes]]] = None, tags: Optional[Sequence[object]] = None) -> PutResult:
        ok, evicted = [False] * len(keys), []
        with self._write_lock:
            for i, (key, buf) in enumerate(zip(keys, buffers)):
                key = bytes(key)
                with self._lock:
                    if key in self._pages:
                        ok[i] = True
                        continue
                    while len(self._pages) >= self.capacity_pages:
                        victim = self._order.peek_victim()
                        if victim is None:
                            break
                        self._drop(victim)
                        evicted.append(victim)
                    if len(self._pages) >= self.capacity_pages:
                        break
                mv = buffer_view(buf)
                path = self._file(key)
                with open(path, "wb") as f:
                    f.write(mv)
                    f.flush()
                    os.fdatasync(f.fileno())
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                parent = None if parents is None or parents[i] is None else bytes(parents[i])
                with self._lock:
                    self._pages[key] = (mv.nbytes, parent)
                    self._order.add(key, parent if parent in self._pages else None)
                ok[i] = True
        return PutResult(ok, evicted, locations=[(self.uuid, 0, 0, len(buffer_view(b)), 0) if good else None
                                                 for good, b in zip(ok, buffers)])

    def _drop(self, key: bytes) -> None:
        self._pages.pop(key, None)
        self._order.remove(key)
        try:
            os.remove(self._file(key))
        except FileNotFoundError:
            pass

    def get(self, keys: Sequence[bytes], buffers: Sequence[BufferLike]) -> List[bool]:
        out = []
        with self._read_lock:  # one page at a time, in order
            for key, buf in zip(keys, buffers):
                key = bytes(key)
                with self._lock:
                    known = key in self._pages
                    if known:
                        self._order.touch(key)
                if not known:
                    out.append(False)
                    continue
                mv = buffer_view(buf)
                try:
                    with open(self._file(key), "rb", buffering=0) as f:
                        out.append(f.readinto(mv) == mv.nbytes)
                except FileNotFoundError:
                    out.append(False)
        return out

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        with self._lock:
            return [bytes(k) in self._pages for k in keys]

    def leading_run(self, keys: Sequence[bytes]) -> int:
        n = 0
        for present in self.exists(keys):
            if not present:
                break
            n += 1
        return n

    def location(self, key: bytes) -> Optional[PageLocation]:
        with self._lock:
            p = self._pages.get(bytes(key))
        return None if p is None else PageLocation(self.uuid, 0, 0, p[0], 0)

    def read_locations(self, locations: Sequence[PageLocation], keys: Sequence[bytes],
                       buffers: Sequence[BufferLike]) -> List[bool]:
        return self.get(keys, buffers)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if bytes(k) in self._pages:
                    self._drop(bytes(k))
                    n += 1
            return n

    def clear(self) -> int:
        with self._lock:
            keys = list(self._pages)
        return self.delete(keys)

    def stats(self) -> Dict[str, object]:
        with self._lock:
            return {"path": self.directory, "used_pages": len(self._pages), "capacity_pages": self.capacity_pages}

    def register_memory(self, regions: Sequence[Tuple[int, int]]) -> bool:
        """Buffered file I/O registers nothing."""
        return False

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._order.touch(bytes(k))

    def hold(self, keys: Sequence[bytes], held: bool = True) -> None:
        """The baseline knows nothing of the tiers above it."""

    def entries(self) -> Iterator[Tuple[bytes, Optional[bytes], PageLocation]]:
        with self._lock:
            items = list(self._pages.items())
        for key, (length, parent) in items:
            yield key, parent, PageLocation(self.uuid, 0, 0, length, 0)

    def take_dropped(self) -> List[bytes]:
        """The baseline never drops a page outside a put."""
        return []

    def __len__(self) -> int:
        with self._lock:
            return len(self._pages)

    def close(self) -> None:
        pass
