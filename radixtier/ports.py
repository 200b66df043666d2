"""Loopback ports for the servers radixtier starts itself (SGLang for the demo, tests and benches;
redis-server for tests): free now, and below the kernel's ephemeral range.

Why below it: a port the kernel handed out with bind(0) comes from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), and once the server on it stops,
the kernel may give the same number to an outgoing connection meanwhile; a server restarted on its
own port then fails to bind (uvicorn exits with status 3). Ports below the range are never handed
to outgoing connections.
"""

from __future__ import annotations

import random
import socket
from typing import Callable, Optional

LOWEST = 15000  # above the well-known and most registered service ports


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP socket can bind `port` on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1", also_free: Optional[Callable[[int], bool]] = None) -> int:
    """A port below the ephemeral range that binds now (and for which `also_free(port)` holds, e.g.
    a Redis Cluster node's bus port); RuntimeError after many tries."""
    top = max(LOWEST + 1000, ephemeral_start())
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(LOWEST, top)
        if is_free(port, host) and (also_free is None or also_free(port)):
            return port
    raise RuntimeError(f"no free loopback port in {LOWEST}..{top - 1}")
