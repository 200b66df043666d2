"""The `sglang.srt.plugins` entry point: SGLang calls register() once per process at start-up.

SGLang loads plugins before it configures logging, so nothing register() logs would be seen.
register() therefore only hooks `ServerArgs.check_server_args` through SGLang's own HookRegistry;
that runs in the launching process after SGLang configured its logger and before any scheduler
starts. There radixtier (1) checks its extra_config when it is the selected backend, so a bad key
or value fails the launch in seconds with the one-line error, before a model is loaded or a
namespace created; (2) logs one line: what it will use, or how to select it; (3) warns when the
prefetch policy is `best_effort`, which on a lightly loaded server discards every tier-3 read.
It also names radixtier's KV-event publisher in SGLang's EventPublisherFactory (tier-3 events in
SGLang's own stream: kv_events.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from typing import Any, Dict, Optional

log = logging.getLogger("radixtier.sglang")

BACKEND_NAME = "radixtier"
MODULE_PATH = "radixtier.integrations.sglang"
CLASS_NAME = "RadixTierStorage"
CHECK_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"


def backend_extra_config(**radixtier_keys: Any) -> Dict[str, Any]:
    """`--hicache-storage-backend-extra-config` selecting radixtier with zero-copy pages and prefix keys."""
    return {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH, "class_name": CLASS_NAME,
            "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, **radixtier_keys}


LAUNCH_HINT = ("--enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-prefetch-policy "
               "wait_complete --hicache-storage-backend-extra-config '"
               + json.dumps(backend_extra_config(path="..."), separators=(",", ":")) + "'")


def register() -> bool:
    """Hook SGLang's argument check (see the module docstring); False where SGLang cannot host us.

    The backend is not added to SGLang's StorageBackendFactory registry: 0.5.23 builds
    registered names through a fixed list of built-ins (a new name would fail there) and its
    `--hicache-storage-backend` flag accepts built-in names only, so `dynamic` is the route.
    """
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return False
    HookRegistry.register(CHECK_TARGET, after_check_server_args, HookType.AFTER)
    register_event_publisher()
    return True


EVENT_PUBLISHER = "radixtier"


def register_event_publisher() -> None:
    """Make `--kv-events-config '{"publisher": "radixtier", ...}'` build radixtier's KV-event
    publisher (event_stream.py: SGLang's ZMQ publisher whose stream also carries tier 3). The
    constructor imports it only when SGLang builds one."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    try:
        EventPublisherFactory.register_publisher(EVENT_PUBLISHER, _make_event_publisher)
    except KeyError:  # registered already in this process
        pass


def _make_event_publisher(attn_dp_rank: int = 0, **config: Any) -> Any:
    from radixtier.integrations.sglang.events.stream import RadixtierEventPublisher

    return RadixtierEventPublisher(attn_dp_rank, **config)


def selected_extra_config(server_args: Any) -> Optional[Dict[str, Any]]:
    """radixtier's keys from the server's extra_config when radixtier is its L3 backend, else None.

    Parsed by SGLang's own parser (a JSON string, or @file in JSON/TOML/YAML); SGLang's keys it
    consumes (prefetch_*, hicache_storage_pass_prefix_keys) are gone from what it returns."""
    raw = server_args.hicache_storage_backend_extra_config
    if not server_args.enable_hierarchical_cache or server_args.hicache_storage_backend != "dynamic" or not raw:
        return None
    if not raw.startswith("@") and MODULE_PATH not in raw:  # another dynamic backend: not ours to parse
        return None
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    extra = HybridCacheController.parse_storage_backend_extra_config(raw)[0]
    if extra.get("module_path") != MODULE_PATH or extra.get("class_name") != CLASS_NAME:
        return None
    return extra


def after_check_server_args(result: Any, server_args: Any, *_args: Any, **_kwargs: Any) -> Any:
    """SGLang's HookType.AFTER hook on check_server_args (the launching process only; once per launch)."""
    if multiprocessing.parent_process() is not None:
        return result
    from radixtier.integrations.sglang.backend.config import BackendConfig, ConfigError

    try:
        extra = selected_extra_config(server_args)
        if extra is None:
            if server_args.enable_hierarchical_cache:
                log.info("radixtier: HiCache storage backend available; select it with %s", LAUNCH_HINT)
            return result
        cfg = BackendConfig.from_extra_config(extra)  # ConfigError (one line, naming the key) fails the launch
    except ConfigError:
        raise
    except Exception as exc:  # reading another backend's config must never break its launch
        log.warning("radixtier: could not read --hicache-storage-backend-extra-config (%s); the backend checks "
                    "its own settings when it starts", exc)
        return result
    log.info("radixtier: L3 backend: namespace %s, index %s, node %s (ranks write partitions %d+)", cfg.path,
             cfg.redis_url or "in-process", cfg.node_id, cfg.partition)
    if server_args.hicache_storage_prefetch_policy == "best_effort":
        log.warning("radixtier: --hicache-storage-prefetch-policy best_effort: SGLang admits a request as soon "
                    "as it is scheduled and drops the tier-3 read still in flight, so on a lightly loaded "
                    "server no prefix comes from tier 3; use wait_complete (or timeout)")
    return result
