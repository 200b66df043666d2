"""Opening a namespace target: an NVMe-oF block device (or loop device), or a plain file.

O_DIRECT is used where the target allows it, so page reads go straight from flash into the
caller's buffers instead of through (and evicting) the page cache; a target that refuses it
(tmpfs, some overlay filesystems) falls back to buffered I/O with the reason logged.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
from dataclasses import dataclass

log = logging.getLogger("radixtier.storage.nvmeof.target")

BLKGETSIZE64 = 0x80081272
BLKSSZGET = 0x1268


@dataclass
class Target:
    path: str
    fd: int
    direct: bool
    is_block: bool
    size: int
    logical_block: int
    why_buffered: str = ""

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _block_size_bytes(fd: int) -> int:
    buf = fcntl.ioctl(fd, BLKGETSIZE64, b"\x00" * 8)
    return struct.unpack("<Q", buf)[0]


def _logical_block(fd: int) -> int:
    try:
        buf = fcntl.ioctl(fd, BLKSSZGET, b"\x00" * 4)
        return struct.unpack("<i", buf)[0]
    except OSError:
        return 512


def _probe_direct(fd: int) -> str:
    """'' if an aligned O_DIRECT read works on this fd, else why not."""
    import mmap

    buf = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [buf], 0)
        return ""
    except OSError as exc:
        return f"O_DIRECT read failed: {exc.strerror}"
    finally:
        buf.close()


def open_target(path: str, create_bytes: int = 0, direct: bool = True, readonly: bool = False) -> Target:
    """Open `path`; a missing file is created with `create_bytes` (sparse) when that is > 0."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"path: expected a device or file path, got {path!r}")
    exists = os.path.exists(path)
    if not exists and create_bytes <= 0:
        raise FileNotFoundError(f"path: {path} does not exist (give a capacity to create a file namespace)")
    if exists:
        st = os.stat(path)
        is_block = stat.S_ISBLK(st.st_mode)
        if not is_block and not stat.S_ISREG(st.st_mode):
            raise ValueError(f"path: {path} is neither a block device nor a regular file")
    else:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"path: directory {parent} does not exist")
        is_block = False
    flags = (os.O_RDONLY if readonly else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | (0 if exists else os.O_CREAT), 0o644)
    try:
        if is_block:
            size, logical = _block_size_bytes(fd), _logical_block(fd)
        else:
            size, logical = os.fstat(fd).st_size, 512
            if size < create_bytes and not readonly:
                os.ftruncate(fd, create_bytes)
                size = create_bytes
    except BaseException:
        os.close(fd)
        raise
    why = "direct I/O disabled by configuration"
    if direct:
        try:
            dfd = os.open(path, flags | os.O_DIRECT)
        except OSError as exc:
            why = f"open with O_DIRECT failed: {exc.strerror}"
        else:
            why = _probe_direct(dfd)
            if why:
                os.close(dfd)
            else:
                os.close(fd)
                fd = dfd
        if why:
            log.warning("radixtier: %s: using buffered I/O (%s)", path, why)
    return Target(path, fd, why == "", is_block, size, logical, why)


def reserve_file_space(t: Target, nbytes: int) -> str:
    """Allocate a file namespace's blocks up front (fallocate): a full filesystem then fails the
    format, not a later write, and a page's first write skips block allocation (on ext4 a fresh
    sparse namespace took its first 8 MiB pages at about half the speed of an allocated one).
    Returns '' once reserved, or why the filesystem cannot (the namespace then stays sparse);
    ValueError when the filesystem lacks the room -- checked before allocating, so a namespace
    too big never fills the disk on its way to failing."""
    import ctypes
    import errno

    st = os.fstatvfs(t.fd)
    free = st.f_bavail * st.f_frsize + os.fstat(t.fd).st_blocks * 512
    if nbytes > free:
        raise ValueError(f"capacity: {nbytes} bytes asked for {t.path}, its filesystem has room for {free}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(t.fd, 0, ctypes.c_int64(0), ctypes.c_int64(nbytes)) == 0:
        return ""
    err = ctypes.get_errno()
    if err == errno.ENOSPC:
        raise ValueError(f"capacity: {nbytes} bytes asked for {t.path}, its filesystem ran out of room")
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return f"the filesystem does not allocate ahead ({os.strerror(err)})"
    raise OSError(err, f"{t.path}: reserving {nbytes} bytes failed: {os.strerror(err)}")


def read_aligned(t: Target, offset: int, nbytes: int) -> bytes:
    """`nbytes` at `offset` through an aligned buffer (O_DIRECT-safe); past the end reads as zeros."""
    import mmap

    buf = mmap.mmap(-1, max(4096, (nbytes + 4095) // 4096 * 4096))
    try:
        n = os.preadv(t.fd, [buf], offset)
        return bytes(buf[:max(0, min(n, nbytes))]).ljust(nbytes, b"\x00")
    finally:
        buf.close()


def write_aligned(t: Target, offset: int, data: bytes) -> None:
    """Write `data`, zero-padded to whole 4 KiB blocks (O_DIRECT-safe), at `offset`; short writes raise."""
    import mmap

    size = max(4096, (len(data) + 4095) // 4096 * 4096)
    buf = mmap.mmap(-1, size)
    try:
        buf[:len(data)] = data
        n = os.pwritev(t.fd, [buf], offset)
        if n != size:
            raise OSError(f"{t.path}: short write at offset {offset} ({n} of {size} bytes)")
    finally:
        buf.close()
