"""The write policy's questions about one node: is it hot, and must a copy outlive its eviction.

Pure functions of the configuration, the node and whether a store exists; they change nothing.
Called with the cache lock held (the node's fields are read) by the planner, the writer and the
evictor, which all need the same answers.
"""

from __future__ import annotations

from radixtier.cache.state import CacheState
from radixtier.policies import WritePolicy
from radixtier.tree import Node


def is_hot(s: CacheState, node: Node) -> bool:
    """write_through_selective: a node hit often enough is copied down the tiers."""
    cfg = s.config
    return cfg.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE and node.hits >= cfg.write_through_threshold


def write_down(s: CacheState, node: Node) -> bool:
    """write_through with hold hints: tier 3 may have let go of a page while we held it; the last
    upper-tier copy is not dropped without writing it back down."""
    return (s.config.hold_hints and s.store is not None and not node.in_storage
            and s.config.write_policy == WritePolicy.WRITE_THROUGH)


def must_keep_copy(s: CacheState, node: Node) -> bool:
    """Whether a victim's pages must be copied down a tier (or to tier 3) before they leave this one."""
    return s.config.write_policy == WritePolicy.WRITE_BACK or is_hot(s, node) or write_down(s, node)
