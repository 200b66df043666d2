"""The `sglang.srt.plugins` entry point: SGLang calls register() once per process at start-up."""

from __future__ import annotations

import logging

log = logging.getLogger("radixtier.sglang")

BACKEND_NAME = "radixtier"
MODULE_PATH = "radixtier.integrations.sglang"
CLASS_NAME = "RadixTierStorage"
LAUNCH_HINT = ("--enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
               f"'{{\"backend_name\":\"{BACKEND_NAME}\",\"module_path\":\"{MODULE_PATH}\",\"class_name\":"
               f"\"{CLASS_NAME}\",\"interface_v1\":1,\"hicache_storage_pass_prefix_keys\":true,\"path\":...}}'")


def register() -> bool:
    """Check that the backend can load here and tell the operator how to select it.

    The backend is not added to SGLang's StorageBackendFactory registry: 0.5.23 builds
    registered names through a fixed list of built-ins (a new name would fail there) and its
    `--hicache-storage-backend` flag accepts built-in names only, so `dynamic` is the route.
    """
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
    except ImportError as exc:
        log.warning("radixtier: SGLang's hicache_storage is not importable (%s); radixtier backend unavailable", exc)
        return False
    log.info("radixtier: HiCache storage backend available; select it with %s", LAUNCH_HINT)
    return True
