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


def positive_seconds(field: str, value: object) -> float:
    """`value` as a finite number of seconds > 0, or ValueError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{field}: expected a positive, finite number of seconds, got {value!r}")
    return float(value)
