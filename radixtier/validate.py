"""Shared checks for configuration values: one-line errors that name the field and the value.

Every entry point (Python API, CLI, SGLang extra_config) runs values through these, so `1.5`
pages, `nan` seconds or a bool where a count belongs are refused the same way everywhere.
"""

from __future__ import annotations

import math

_MAX_BYTES = 1 << 62  # far beyond any device; keeps sizes inside a signed 64-bit offset


def positive_int(field: str, value: object, maximum: int = _MAX_BYTES) -> int:
    """`value` as an int in 1..maximum, or ValueError naming `field` (1.5, True and '4' are refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{field}: expected a whole number from 1 to {maximum}, got {value!r}")
    return value


def positive_seconds(field: str, value: object, minimum: float = 0.0, maximum: float = math.inf) -> float:
    """`value` as a finite number of seconds in (minimum, maximum] (> 0), or ValueError naming `field`."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            or not minimum <= value <= maximum):
        span = "a positive, finite number of seconds"
        if minimum > 0 or maximum < math.inf:
            span = f"a number of seconds from {minimum:g} to {maximum:g}"
        raise ValueError(f"{field}: expected {span}, got {value!r}")
    return float(value)


NODE_ID_MAX_BYTES = 48  # what a partition lease records; the SGLang plugin keeps 8 for its ".r<rank>" suffix
VERIFY_MODES = ("auto", "none", "headers", "full")  # slot checks when a namespace is opened
SSL_CERT_REQS = ("required", "optional", "none")


def node_id(field: str, value: object, max_bytes: int = NODE_ID_MAX_BYTES) -> str:
    """A node's id in leases and the index: 1..max_bytes bytes, no braces, colons or whitespace
    (braces are Redis Cluster hash tags and colons separate index key parts)."""
    if (not isinstance(value, str) or not value or len(value.encode()) > max_bytes
            or any(c in value for c in "{}:") or any(c.isspace() or not c.isprintable() for c in value)):
        raise ValueError(f"{field}: expected 1-{max_bytes} printable bytes without braces, colons or spaces, "
                         f"got {value!r}")
    return value


def one_of(field: str, value: object, allowed: tuple) -> object:
    if value not in allowed:
        raise ValueError(f"{field}: expected one of {', '.join(map(str, allowed))}, got {value!r}")
    return value
