"""Opening one rank's view of the tier: its partition of the namespace and the prefix index.

Ranks of one node start at the same time and may all find the namespace file missing, so when
they may create it (`capacity` set) they serialise on a lock of the folder that holds it (flock on
the directory: no lock file is left beside the namespace, and none can be removed under a
waiter); each rank then takes its own partition (`partition + rank index`), so ranks and nodes
never write each other's slots.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from typing import Dict

from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError
from radixtier.storage.nvmeof.layout import FormatError, Superblock
from radixtier.storage.nvmeof.namespace import open_namespace
from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.storage.api import PrefixIndex
from radixtier.storage.index.inprocess import InProcessIndex, InProcessRegistry
from radixtier.storage.publisher import store_records

log = logging.getLogger("radixtier.sglang")

_REGISTRIES: Dict[str, InProcessRegistry] = {}  # namespace uuid -> the in-process index of that namespace
_REGISTRIES_LOCK = threading.Lock()


def open_partition(cfg: BackendConfig, page_bytes: int, rank_index: int, node_id: str) -> NvmeofPageStore:
    """This rank's store: creates a file namespace if asked to (capacity), checks its page size.
    The namespace is opened once (its superblock read once); the checks below see the superblock
    it has, or, for one about to be created, the one it will get (nothing is created if they fail)."""
    partition = cfg.partition + rank_index
    path = cfg.path
    is_file = not os.path.exists(path) or os.path.isfile(path)
    if not os.path.exists(path) and not cfg.capacity:
        raise ConfigError(f"path: {path} does not exist; set capacity (e.g. \"capacity\": \"64GiB\") to "
                          f"create a file namespace, or format a device with `radixtier format`")
    if is_file and os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def check(sb: Superblock, created: bool) -> None:
        if created:
            if partition >= cfg.partitions:
                raise ConfigError(f"partitions: rank {rank_index} needs partition {partition}; create the "
                                  f"namespace with at least {partition + 1} partitions, got {cfg.partitions}")
            return
        if sb.page_bytes < page_bytes:
            raise ConfigError(f"page_bytes: {path} holds pages of {sb.page_bytes} bytes, this model's "
                              f"pages need {page_bytes}; reformat it (`radixtier format --force`) or use "
                              f"another path")
        if partition >= sb.partitions:
            raise ConfigError(f"partition: rank {rank_index} needs partition {partition}, {path} has "
                              f"{sb.partitions} (partitions 0..{sb.partitions - 1}); reformat with more "
                              f"--partitions or lower partition")

    lock_fd = _lock_creation(path) if is_file and cfg.capacity else None
    try:
        try:
            ns = open_namespace(path, None, create_bytes=cfg.capacity, partitions=cfg.partitions,
                                direct=cfg.store.direct, check=check, create_page_bytes=page_bytes)
            return NvmeofPageStore(ns, partition=partition, node_id=node_id, config=cfg.store)
        except (FormatError, RuntimeError) as exc:
            raise ConfigError(f"path: {exc}") from None
    finally:
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)


def _lock_creation(path: str) -> int:
    """flock on the namespace's folder, held while a rank may create the file: one creator, and the
    others open what it formatted (never a half-formatted file). Without `capacity` nothing is
    created and no lock is taken (a filesystem without flock, such as some NFS mounts, works that way)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"capacity: cannot lock {folder} to create {path} ({exc.strerror}); format it once with "
                          f"`radixtier format {path} --capacity ...` and leave capacity out") from None
    return fd


def open_index(cfg: BackendConfig, store: NvmeofPageStore, node_id: str) -> PrefixIndex:
    """Redis when redis_url is set (fleet-wide); otherwise the in-process index of this namespace."""
    if not cfg.redis_url:
        with _REGISTRIES_LOCK:
            registry = _REGISTRIES.setdefault(store.uuid, InProcessRegistry())
        index = InProcessIndex(node_id, registry)
        for root, key, rec in store_records(store, node_id):
            index.publish(root, [key], [rec])
        return index  # the backend's Publisher sets its republisher (Redis uses it after outages)
    from radixtier.storage.index.redis_index import RedisPrefixIndex

    rc = cfg.index_config(node_id)
    try:
        return RedisPrefixIndex(rc)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def index_node_id(node_id: str, rank_index: int, sole_rank: bool) -> str:
    """One index identity per process, so a rank's liveness and records are its own.

    rank_index counts DP ranks too: attention-DP ranks of one node must not share an identity,
    or they overwrite each other's records and one rank's close() makes the others look dead.
    """
    return node_id if sole_rank else f"{node_id}.r{rank_index}"
