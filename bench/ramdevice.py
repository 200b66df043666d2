"""A RAM-backed block device for stable bandwidth figures: a file in /dev/shm -> losetup (direct I/O)
-> ext4 -> mounted in a temp dir. Created for one bench run and removed after it, also on error.

A virtio disk on these machines swings 2x between adjacent fio runs; a RAM-backed loop device
keeps the block layer, O_DIRECT and the filesystem in the path but not the disk's noise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Iterator


class RamDeviceUnavailable(RuntimeError):
    """Why no RAM device could be made here (not root, no losetup, no loop devices...)."""


def _run(*cmd: str) -> str:
    try:
        out = subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RamDeviceUnavailable(f"{cmd[0]} is not installed") from None
    except subprocess.CalledProcessError as exc:
        raise RamDeviceUnavailable(f"{' '.join(cmd[:2])} failed: {(exc.stderr or exc.stdout).strip()}") from None
    return out.stdout.strip()


@contextlib.contextmanager
def ram_device(nbytes: int) -> Iterator[str]:
    """Yield the mount point of a fresh ext4 on a RAM-backed loop device of nbytes."""
    if os.geteuid() != 0:
        raise RamDeviceUnavailable("needs root (losetup, mkfs, mount)")
    free = shutil.disk_usage("/dev/shm").free
    if nbytes > free * 0.8:
        raise RamDeviceUnavailable(f"/dev/shm has {free >> 20} MiB free, {nbytes >> 20} MiB asked")
    image = os.path.join("/dev/shm", f"radixtier-bench-{os.getpid()}.img")
    mount = tempfile.mkdtemp(prefix="radixtier-ramdev-")
    loop = ""
    mounted = False
    try:
        with open(image, "wb") as f:
            f.truncate(nbytes)
        loop = _run("losetup", "--direct-io=on", "-f", "--show", image)
        _run("mkfs.ext4", "-q", "-F", loop)
        _run("mount", loop, mount)
        mounted = True
        yield mount
    finally:
        if mounted:
            subprocess.run(["umount", mount], check=False, capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.remove(image)
        with contextlib.suppress(OSError):
            os.rmdir(mount)
