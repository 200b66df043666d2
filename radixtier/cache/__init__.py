"""The embedded three-tier cache (TieredKVCache) and its parts; see facade.py for the map and lock order."""

from radixtier.cache.config import CacheConfig
from radixtier.cache.facade import TieredKVCache
from radixtier.cache.handle import LoadResult, MatchResult, PrefixHandle

__all__ = ["CacheConfig", "LoadResult", "MatchResult", "PrefixHandle", "TieredKVCache"]
