"""SGLang page keys -> radixtier store keys, and the chain each call's pages belong to.

SGLang's page keys are chained hashes (each commits to every token before it) but are the
same on every TP/PP rank and in every layout. A store key therefore also commits to what
makes the bytes differ: the rank's shard, the pool, the host layout, the dtype and, where the
two byte orders differ (layer_first), which interface wrote the page. Two ranks or two
layouts never read each other's bytes as their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from radixtier.hashing import page_key

KV_POOL = "kv"
TP_SHARDED_POOLS = frozenset({"mamba"})  # TP-sharded even when the model's MLA KV is replicated


def _digest(text: str) -> bytes:
    return page_key(text.encode())


@dataclass(frozen=True)
class RankIdentity:
    """Which shard of every page this process holds (mirrors SGLang's HiCacheFile suffixes)."""

    model: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    dp_rank: int = 0
    is_mla: bool = False
    is_writer: bool = True

    @classmethod
    def from_storage_config(cls, sc) -> "RankIdentity":
        model = "-".join((sc.model_name or "").split("/"))
        return cls(model=model, tp_rank=sc.tp_rank, tp_size=sc.tp_size, pp_rank=sc.pp_rank, pp_size=sc.pp_size,
                   cp_rank=getattr(sc, "attn_cp_rank", 0), cp_size=getattr(sc, "attn_cp_size", 1),
                   dcp_rank=getattr(sc, "dcp_rank", 0), dcp_size=getattr(sc, "dcp_size", 1),
                   dp_rank=getattr(sc, "dp_rank", 0), is_mla=bool(sc.is_mla_model),
                   is_writer=bool(getattr(sc, "is_storage_writer", True)))

    def shard_suffix(self) -> str:
        s = f"_{self.pp_size}_{self.pp_rank}" if self.pp_size > 1 else ""
        if self.cp_size > 1:
            s += f"_cp{self.cp_rank}_{self.cp_size}"
        if self.dcp_size > 1:
            s += f"_tp{self.tp_size}_dcp{self.dcp_rank}_{self.dcp_size}"
        return s

    def tp_suffix(self) -> str:
        return f"_{self.model}_{self.tp_rank}_{self.tp_size}{self.shard_suffix()}"

    def replicated_suffix(self) -> str:
        """Suffix of pages every TP rank holds identically (MLA KV): one copy serves all ranks."""
        return f"_{self.model}{self.shard_suffix()}"

    def rank_index(self) -> int:
        """This process's position among the writers of one node (DP included), for its own partition."""
        return ((self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank) * self.cp_size + self.cp_rank

    def is_sole_rank(self) -> bool:
        """Whether this process may use the plain node_id (tp = pp = cp = 1, rank index 0). SGLang's
        config has dp_rank but no dp_size, so attention-DP rank 0 cannot tell it has siblings; it
        keeps the plain id and every other DP rank gets `.r<index>`, so the ids still differ."""
        return self.tp_size == self.pp_size == self.cp_size == 1 and self.rank_index() == 0

    def writes(self, pool: str) -> bool:
        """MLA KV is written once, by the storage writer; TP-sharded state by every rank."""
        return self.is_writer or not self.is_mla or pool in TP_SHARDED_POOLS

    def suffix(self, pool: str) -> str:
        if self.is_mla and pool not in TP_SHARDED_POOLS:
            return self.replicated_suffix()
        return self.tp_suffix()


@dataclass(frozen=True)
class PoolFormat:
    """What the bytes of one pool's pages look like; part of every key of that pool."""

    pool: str
    layout: str
    dtype: str
    page_bytes: int
    zero_copy: bool = False  # get_page_buffer_meta works for this pool's layout (probed at registration)

    def tag(self, interface: str) -> str:
        # In layer_first the zero-copy pointer walk (per layer: K, V) and the flat page
        # (all K, then all V) order the same bytes differently; elsewhere they agree.
        wire = interface if self.layout == "layer_first" else "any"
        return f"{self.pool}|{self.layout}|{self.dtype}|{self.page_bytes}|{wire}"


@dataclass
class Chain:
    """Store keys of one call, with each page's parent and the chain's root (index hash tag).

    root is None for a read whose chain start is unknown: SGLang's prefetch passes the anchor
    node's *ancestors* as prefix keys (the anchor's own pages are left out), and nothing at all
    when the anchor hangs under the tree's root, so its first key need not start the chain."""

    keys: List[bytes]
    parents: List[Optional[bytes]]
    root: Optional[bytes]


class KeyMapper:
    """Derives store keys for one rank; pure functions of SGLang's keys and the pool format."""

    def __init__(self, rank: RankIdentity) -> None:
        self.rank = rank

    def store_key(self, key: str, fmt: PoolFormat, interface: str) -> bytes:
        return self.store_keys([key], fmt, interface)[0]

    def store_keys(self, keys: Sequence[str], fmt: PoolFormat, interface: str) -> List[bytes]:
        """store_key of each key; the rank/format tail is built once per call, not per page."""
        tail = f"{self.rank.suffix(fmt.pool)}|{fmt.tag(interface)}".encode()
        out = []
        for key in keys:
            if type(key) is not str or not key:
                raise ValueError(f"key: expected a non-empty page hash string, got {key!r}")
            out.append(page_key(key.encode() + tail))
        return out

    def chain(self, keys: Sequence[str], prefix_keys: Optional[Sequence[str]], fmt: PoolFormat,
              interface: str, continues: bool = True, for_read: bool = False) -> Chain:
        """One call's chain. For writes SGLang passes contiguous prefix keys (a backup's
        prefix_keys + keys is one chain); for reads the prefix keys are ancestors only.

        Either way prefix_keys[0], when there is one, is the sequence's first page: the root.
        Without prefix keys a write starts its chain (its first key is the root) and a read does
        not know its root (None: the index resolves it from the first key's root pointer).
        continues=False: this pool does not hold the prefix's pages (a trailing window), so the
        first page gets no parent, but the chain keeps the sequence's root so that the index
        groups (and other nodes find) its records under the same root as batch_exists_v2 asks.
        """
        skeys = self.store_keys(keys, fmt, interface)
        root: Optional[bytes]
        if prefix_keys:
            first_parent: Optional[bytes] = self.store_key(prefix_keys[-1], fmt, interface) if continues else None
            root = self.store_key(prefix_keys[0], fmt, interface)
        else:
            first_parent = None
            root = None if for_read else (skeys[0] if skeys else _digest("empty"))
        parents: List[Optional[bytes]] = [first_parent] + skeys[:-1] if skeys else []
        return Chain(skeys, parents, root)


def leading_true(flags: Sequence[bool]) -> int:
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
