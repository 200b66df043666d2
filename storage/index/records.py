"""msgpack records of the prefix index, and their validation: nothing read from Redis is trusted."""

from __future__ import annotations

import time
from typing import Optional

import msgpack

from radixtier.storage.api import HOST_TIER, STORAGE_TIER, PageLocation
from radixtier.storage.api import PageRecord

RECORD_VERSION = 1
TIERS = (STORAGE_TIER, HOST_TIER)
_MAX_U64 = (1 << 64) - 1


class RecordError(ValueError):
    """A record that does not decode or does not make sense; it is ignored, never used."""


def encode_record(rec: PageRecord) -> bytes:
    loc = rec.location
    return msgpack.packb({"v": RECORD_VERSION, "node": rec.node_id, "tier": rec.tier, "ns": loc.namespace,
                          "slot": loc.slot, "gen": loc.generation, "len": loc.length, "crc": loc.checksum,
                          "ts": int(time.time())}, use_bin_type=True)


def _int(d: dict, k: str, lo: int, hi: int) -> int:
    v = d.get(k)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise RecordError(f"field {k!r}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def decode_record(raw: bytes, field_node: Optional[str] = None) -> PageRecord:
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RecordError(f"not msgpack: {exc}") from None
    if not isinstance(d, dict):
        raise RecordError(f"expected a map, got {type(d).__name__}")
    if d.get("v") != RECORD_VERSION:
        raise RecordError(f"field 'v': expected {RECORD_VERSION}, got {d.get('v')!r}")
    node, tier, ns = d.get("node"), d.get("tier"), d.get("ns")
    if not isinstance(node, str) or not 0 < len(node) <= 128:
        raise RecordError(f"field 'node': expected a node id, got {node!r}")
    if field_node is not None and node != field_node:
        raise RecordError(f"record claims node {node!r} but is filed under node {field_node!r}")
    if tier not in TIERS:
        raise RecordError(f"field 'tier': expected one of {TIERS}, got {tier!r}")
    if not isinstance(ns, str) or len(ns) != 32 or any(c not in "0123456789abcdef" for c in ns):
        raise RecordError(f"field 'ns': expected a 32-hex-digit namespace uuid, got {ns!r}")
    loc = PageLocation(ns, _int(d, "slot", 0, _MAX_U64), _int(d, "gen", 1, _MAX_U64),
                       _int(d, "len", 1, 1 << 40), _int(d, "crc", 0, 0xFFFFFFFF))
    return PageRecord(node, tier, loc)
