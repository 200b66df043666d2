"""The prefix index's Redis key names: one place that spells every key, so no part formats its own.

Key layout (prefix = "<key_prefix>:<namespace>"; root = the chain's page 0):

    <prefix>:{<root>}:p:<page>    STRING the page's holders: 96-byte entries (node id, NUL-padded to 48
                                  bytes, then its 48-byte record; at most 16, writers replace the oldest)
    <prefix>:{<page>}:r           STRING the page's root (for lookups that do not know where the chain starts)
    <prefix>:{nodes}:n:<node_id>  STRING with TTL: the node's heartbeat "node|unix time|token" (absent = dead;
                                  the token is random per process start: see identity.py)
    <prefix>:{nodes}:all          SET of node ids ever seen (for garbage collection)
    <prefix>:{nodes}:beats        HASH node -> time of its last heartbeat (kept after the TTL key expires)
    <prefix>:{nodes}:gc           STRING NX lock: one collector at a time
    <prefix>:{o:<node_id>}        HASH page -> root: what the node published (for unpublish and GC)

Why a packed value per page: a chain lookup is then one MGET (no script, one server call) whose
cost grows with the chain's length only. The hash tag on the chain root puts a whole chain in one
Redis Cluster slot (one MGET), while chains spread over shards; the page itself tags its root
pointer, and {nodes} keeps the registry in one slot.
"""

from __future__ import annotations


class Keys:
    """Key names under one prefix; immutable (read by every thread without a lock)."""

    __slots__ = ("prefix", "node_set", "beats", "gc_lock", "nodes_tag")

    def __init__(self, key_prefix: str, namespace: str) -> None:
        self.prefix = f"{key_prefix}:{namespace}"
        self.nodes_tag = f"{self.prefix}:{{nodes}}"  # the registry's keys share this slot
        self.node_set = f"{self.nodes_tag}:all"
        self.beats = f"{self.nodes_tag}:beats"
        self.gc_lock = f"{self.nodes_tag}:gc"

    def page(self, root: bytes, key: bytes) -> str:
        return f"{self.prefix}:{{{root.hex()}}}:p:{key.hex()}"

    def page_hex(self, root_hex: str, key_hex: str) -> str:
        """page() for a root and key already in hex (as a pages hash holds them)."""
        return f"{self.prefix}:{{{root_hex}}}:p:{key_hex}"

    def chain_prefix(self, root: bytes) -> str:
        """What every page key of `root`'s chain starts with (the page's hex follows)."""
        return f"{self.prefix}:{{{root.hex()}}}:p:"

    def root_ptr(self, key: bytes) -> str:
        """Where a page's chain root is recorded (the page itself is the hash tag: one slot)."""
        return f"{self.prefix}:{{{key.hex()}}}:r"

    def node(self, node: str) -> str:
        """A node's heartbeat."""
        return f"{self.nodes_tag}:n:{node}"

    def owned(self, node: str) -> str:
        """A node's pages hash (page -> root)."""
        return f"{self.prefix}:{{o:{node}}}"

    def owned_raw(self, member: bytes) -> bytes:
        """owned() for a node id as the node set holds it (bytes that may not be UTF-8)."""
        return self.prefix.encode() + b":{o:" + member + b"}"
