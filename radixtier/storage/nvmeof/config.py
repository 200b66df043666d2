"""StoreConfig: how a page store runs its namespace, in one frozen, validated object.

The store owns this type; the SGLang backend's config embeds it (extra_config keys of the same
names fill it) instead of re-declaring its fields, so a default or a check lives in one place.
Per-open facts (path, partition, node id, page size, the capacity a new file gets) are not here:
they say which namespace, not how to run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from radixtier.eviction import EVICTION_MODES, LEAVES_FIRST
from radixtier.storage.nvmeof.io_engine import ENGINES, MAX_QUEUE_DEPTH
from radixtier.storage.nvmeof.lease import DEFAULT_LEASE_S, check_timing, default_io_timeout_s
from radixtier.validate import VERIFY_MODES, one_of, positive_int

DEFAULT_COALESCE_BYTES = 1 << 20  # largest vectored I/O built from adjacent slots


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one opened partition; ValueError naming the field on a bad value."""

    io_engine: str = "auto"         # io_uring where the kernel allows it, else a preadv/pwritev pool
    queue_depth: int = 16           # I/Os in flight per call
    direct: bool = True             # O_DIRECT (the page cache would double every page in DRAM)
    sync: bool = True               # fdatasync before the slot table names a page
    verify: str = "auto"            # slot checks at open: auto = headers after an unclean stop
    eviction: str = LEAVES_FIRST    # victim order when the partition is full
    coalesce_bytes: int = DEFAULT_COALESCE_BYTES  # largest vectored I/O built from adjacent slots
    lease_s: float = DEFAULT_LEASE_S  # partition lease on the device; renewed every lease_s / 4
    # bound on one write reaching the device after its deadline check; the same on every host
    lease_io_timeout_s: float = field(default_factory=default_io_timeout_s)
    force_takeover: bool = False    # take a partition whose lease another host still renews

    def __post_init__(self) -> None:
        one_of("io_engine", self.io_engine, ENGINES)
        one_of("verify", self.verify, VERIFY_MODES)
        one_of("eviction", self.eviction, EVICTION_MODES)
        positive_int("queue_depth", self.queue_depth, MAX_QUEUE_DEPTH)
        positive_int("coalesce_bytes", self.coalesce_bytes)
        lease, io = check_timing(self.lease_s, self.lease_io_timeout_s)
        object.__setattr__(self, "lease_s", lease)
        object.__setattr__(self, "lease_io_timeout_s", io)

    @classmethod
    def keys(cls) -> frozenset:
        """The field names, which are also the extra_config keys that set them."""
        return frozenset(f.name for f in fields(cls))
