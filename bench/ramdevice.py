"""A RAM-backed block device for stable bandwidth figures: a file in /dev/shm -> losetup (direct I/O)
-> ext4 -> mounted in a temp dir. Created for one bench run and removed after it, also on error.

A virtio disk on these machines swings 2x between adjacent fio runs; a RAM-backed loop device
keeps the block layer, O_DIRECT and the filesystem in the path but not the disk's noise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator, List


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def remove_stale_devices() -> List[str]:
    """Unmount, detach and delete RAM devices whose bench process died without cleaning up (a
    crash cannot run the context manager's exit): each holds RAM in /dev/shm until removed, also
    once its image is unlinked, while its loop device stays attached. Returns the images removed."""
    removed = []
    listing = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                             capture_output=True, text=True).stdout
    attached = {}  # image path -> loop devices
    for line in listing.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2:
            attached.setdefault(parts[1].replace(" (deleted)", "").strip(), []).append(parts[0])
    images = {os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")} | set(attached)
    for image in sorted(images):
        m = re.fullmatch(r"/dev/shm/radixtier-bench-(\d+)\.img", image)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        for loop in attached.get(image, []):
            _unmount_all(loop)
            subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.remove(image)
        removed.append(image)
    return removed


def _unmount_all(loop: str) -> None:
    """Unmount every mount of `loop` (lazily when busy: it then goes once its last file closes)."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[0] == loop]
    for point in points:
        _unmount(point)
        with contextlib.suppress(OSError):
            os.rmdir(point)


def _unmount(point: str) -> None:
    """Unmount `point`; when still busy (a caller left a file open) detach it lazily: the kernel frees
    the device, and (autoclear) its loop device and RAM, when the last file on it closes."""
    if subprocess.run(["umount", point], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", point], capture_output=True)


@contextlib.contextmanager
def ram_device(nbytes: int) -> Iterator[str]:
    """Yield the mount point of a fresh ext4 on a RAM-backed loop device of nbytes."""
    if os.geteuid() != 0:
        raise RamDeviceUnavailable("needs root (losetup, mkfs, mount)")
    for image in remove_stale_devices():
        print(f"removed {image}: left by a bench run that died", file=sys.stderr)
    free = shutil.disk_usage("/dev/shm").free
    if nbytes > free * 0.8:
        raise RamDeviceUnavailable(f"/dev/shm has {free >> 20} MiB free, {nbytes >> 20} MiB asked")
    image = os.path.join("/dev/shm", f"radixtier-bench-{os.getpid()}.img")
    mount = tempfile.mkdtemp(prefix="radixtier-ramdev-")
    loop = ""
    mounted = False
    try:
        with open(image, "wb") as f:
            # RAM for every block now (written, not fallocated: tmpfs zeroes a fallocated page on its first
            # write too): a sparse image allocates and zeroes memory on the first write
            # to each block, which on a VM ran at ~0.5 GB/s and made whichever run first wrote a
            # region look several times slower than the same run on blocks written before
            zeros = bytes(64 << 20)
            for pos in range(0, nbytes, len(zeros)):
                f.write(zeros[:min(len(zeros), nbytes - pos)])
        loop = _run("losetup", "--direct-io=on", "-f", "--show", image)
        _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)  # no background init competing
        _run("mount", loop, mount)
        mounted = True
        yield mount
    finally:
        if mounted:
            _unmount(mount)
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.remove(image)
        with contextlib.suppress(OSError):
            os.rmdir(mount)
