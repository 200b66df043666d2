"""The page checksum every tier-3 path shares: CRC-32C over a page's bytes.

Its own module so the NVMe-oF page store (slot headers and table entries), the RDMA transport
(pages moved between hosts) and anything else that proves a page import it downward, rather
than reaching into one backend's on-device format for it. The native core computes the same
value in C (radixtier/storage/nvmeof/_crc32c.c; a test cross-checks the two).
"""

from __future__ import annotations

import crc32c as _crc32c


def checksum(*chunks) -> int:
    """CRC-32C (Castagnoli, hardware-accelerated, GIL released on large buffers) over the chunks."""
    crc = 0
    for c in chunks:
        crc = _crc32c.crc32c(c, value=crc)
    return crc & 0xFFFFFFFF
