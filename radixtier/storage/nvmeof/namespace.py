"""Formatting a namespace, and opening one: the target opened and its superblock read once.

Opening is where a store, the SGLang attach step and the CLI used to each stat the path, read
the superblock and check the page size on their own. Here it happens once: `open_namespace`
decides whether the path is a namespace to create (`will_create`), plans a new one (a caller's
`check` sees the planned superblock before anything is written, so a refused open creates no
file), formats it, or reads the existing superblock, and hands back the open target with it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from radixtier.storage.nvmeof.io_engine import aligned_buffer
from radixtier.storage.nvmeof.layout import BLOCK, FormatError, Superblock
from radixtier.storage.nvmeof.target import Target, open_target, read_aligned, reserve_file_space, write_aligned
from radixtier.validate import positive_int

log = logging.getLogger("radixtier.storage.nvmeof")

# check(superblock, created): raise to refuse; for a namespace about to be created it runs on the
# planned superblock before the file exists
SuperblockCheck = Callable[[Superblock, bool], None]


@dataclass
class OpenedNamespace:
    """An open target and its superblock; whoever holds it closes it (a store takes it over)."""

    target: Target
    sb: Superblock
    created: bool  # formatted by this open

    @property
    def path(self) -> str:
        return self.target.path

    def close(self) -> None:
        self.target.close()


def will_create(path: str) -> bool:
    """Whether opening `path` with a capacity creates (formats) a file namespace: it is missing or an
    empty file. The one definition of a fresh namespace (the SGLang config's room check uses it too)."""
    return not os.path.exists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0)


def open_namespace(path: str, page_bytes: Optional[int] = None, *, create_bytes: int = 0, partitions: int = 1,
                   direct: bool = True, check: Optional[SuperblockCheck] = None,
                   create_page_bytes: Optional[int] = None) -> OpenedNamespace:
    """Open a namespace, formatting a file one first when it is fresh and `create_bytes` is given.

    `page_bytes`, when given, must be the namespace's page size (and is the size a new one gets);
    `create_page_bytes` is only the size a new one gets (`check` judges an existing one's).
    FileNotFoundError when there is nothing to open and nothing to create; FormatError when the
    target is not a namespace this code can use."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"path: expected the path of a block device or file, got {path!r}")
    if page_bytes is not None:
        positive_int("page_bytes", page_bytes)
        create_page_bytes = page_bytes
    elif create_page_bytes is not None:
        positive_int("page_bytes", create_page_bytes)
    if create_bytes:
        positive_int("capacity", create_bytes)
    # nothing there: create it (or say how); an empty file is created only when asked to (create_bytes),
    # else it is read like any target and refused as no namespace
    created = not os.path.exists(path) or (bool(create_bytes) and will_create(path))
    if created:
        if not create_bytes or create_page_bytes is None:
            raise FileNotFoundError(f"path: {path} is not a formatted namespace; give page_bytes and "
                                    f"create_bytes to create one, or run `radixtier format`")
        planned = Superblock.plan(create_page_bytes, create_bytes, partitions, time.time_ns())
        if check is not None:
            check(planned, True)
        sb = format_namespace(path, create_page_bytes, create_bytes, partitions, direct=direct, planned=planned)
    t = open_target(path, direct=direct)
    try:
        if not created:
            sb = Superblock.unpack(read_aligned(t, 0, BLOCK), path)
            if page_bytes is not None and sb.page_bytes != page_bytes:
                raise FormatError(f"{path}: formatted with page_bytes={sb.page_bytes}, asked for "
                                  f"page_bytes={page_bytes}; reformat it (`radixtier format --force`) or use "
                                  f"a matching page size")
            if check is not None:
                check(sb, False)
        if sb.total_bytes > t.size:
            raise FormatError(f"{path}: superblock describes {sb.total_bytes} bytes, target has {t.size}")
    except BaseException:
        t.close()
        raise
    return OpenedNamespace(t, sb, created)


def format_namespace(path: str, page_bytes: int, capacity_bytes: Optional[int] = None, partitions: int = 1,
                     force: bool = False, direct: bool = True, planned: Optional[Superblock] = None) -> Superblock:
    """Write a fresh superblock and empty tables. Refuses to overwrite anything unless force=True.

    A format that fails leaves nothing behind: a file it created is removed, and a target that
    existed keeps whatever superblock it had until the new one is complete (it is written last).
    `planned`: the superblock open_namespace already planned for this capacity (planned once).
    """
    positive_int("page_bytes", page_bytes)
    if capacity_bytes is not None:
        positive_int("capacity", capacity_bytes)
    exists = os.path.exists(path)
    if not exists and capacity_bytes is None:
        raise ValueError(f"capacity: required to create the file namespace {path}")
    if not exists and planned is None:  # fail before creating anything when the geometry cannot work
        planned = Superblock.plan(page_bytes, capacity_bytes, partitions, time.time_ns())
    try:
        return _format(path, page_bytes, capacity_bytes, partitions, force, direct, exists, planned)
    except BaseException:
        if not exists and os.path.isfile(path):
            os.remove(path)
        raise


def _format(path: str, page_bytes: int, capacity_bytes: Optional[int], partitions: int, force: bool,
            direct: bool, exists: bool, planned: Optional[Superblock]) -> Superblock:
    t = open_target(path, create_bytes=capacity_bytes or 0, direct=direct)
    try:
        if not force and exists and t.size > 0:
            head = read_aligned(t, 0, BLOCK)
            try:
                sb = Superblock.unpack(head, path)
                raise FormatError(f"{path}: already a radixtier namespace (uuid {sb.uuid}, page_bytes "
                                  f"{sb.page_bytes}, {sb.slot_count} slots); pass --force to erase it")
            except FormatError as exc:
                if "already" in str(exc):
                    raise
                if any(head):
                    raise FormatError(f"{path}: holds other data (block 0 is not empty); "
                                      f"pass --force to overwrite it") from None
        total = t.size if capacity_bytes is None else capacity_bytes
        if total > t.size:
            if t.is_block:
                raise ValueError(f"capacity: {total} bytes asked, device {path} has {t.size}")
            os.ftruncate(t.fd, total)
        if not t.is_block:
            why = reserve_file_space(t, total)
            if why:
                log.info("radixtier: %s stays sparse: %s", path, why)
        fits = (planned is not None and capacity_bytes is not None and planned.page_bytes == page_bytes
                and planned.partitions == partitions)  # planned for this capacity
        sb = planned if fits else Superblock.plan(page_bytes, total, partitions, time.time_ns())
        zero = aligned_buffer(1 << 20)
        off, end = BLOCK, sb.data_offset  # owner table + slot table
        while off < end:
            n = min(len(zero), end - off)
            os.pwritev(t.fd, [zero[:n]], off)
            off += n
        os.fsync(t.fd)
        write_aligned(t, 0, sb.pack())  # the superblock goes last: a half-formatted target has none
        os.fsync(t.fd)
        return sb
    finally:
        t.close()


def read_superblock(path: str) -> Superblock:
    """The superblock of `path`, read without O_DIRECT (for tools: inspect, plan)."""
    t = open_target(path, direct=False, readonly=True)
    try:
        return Superblock.unpack(read_aligned(t, 0, BLOCK), path)
    finally:
        t.close()
