"""radixtier: a three-tier (HBM / DRAM / NVMe-oF) radix-tree prefix KV cache for SGLang."""

from radixtier.hashing import KVNamespace, PageHasher, as_token_array
from radixtier.tiers import Tier

__all__ = ["KVNamespace", "PageHasher", "Tier", "as_token_array", "__version__"]
__version__ = "0.1.0"
