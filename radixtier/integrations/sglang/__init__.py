"""radixtier as an SGLang 0.5.23 HiCache storage backend.

Launch with `--hicache-storage-backend dynamic` and, in `--hicache-storage-backend-extra-config`,
`"module_path": "radixtier.integrations.sglang", "class_name": "RadixTierStorage"` (README).
The backend class is imported on first use, so importing this package (e.g. for the plugin
entry point) does not pull in SGLang's memory-cache modules.
"""

from typing import Any

__all__ = ["RadixTierStorage", "BackendConfig", "ConfigError"]


def __getattr__(name: str) -> Any:
    if name == "RadixTierStorage":
        from radixtier.integrations.sglang.backend.radixtier_storage import RadixTierStorage

        return RadixTierStorage
    if name in ("BackendConfig", "ConfigError"):
        from radixtier.integrations.sglang.backend import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
