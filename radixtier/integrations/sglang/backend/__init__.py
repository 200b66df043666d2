"""SGLang's storage surface: `RadixTierStorage` (radixtier_storage.py) and what it needs to turn SGLang's
calls into the storage layer's -- extra_config (config.py), the rank's keys (keys.py), the host pools'
pages (host_pools.py), argument checks (arguments.py), opening the partition and index (attach.py) and
SGLang's storage metrics (counters.py). `RadixTierStorage` is imported on first use, so the config
(which the plugin checks in SGLang's launching process) loads neither torch nor SGLang."""

from typing import Any

__all__ = ["RadixTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "RadixTierStorage":
        from radixtier.integrations.sglang.backend.radixtier_storage import RadixTierStorage

        return RadixTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
