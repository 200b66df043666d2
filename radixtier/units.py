"""Byte sizes as operators write them ('4096', '256KiB', '4MiB', '2TB'), for the CLI and configs."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
MAX_SIZE = 1 << 62  # 4 EiB: beyond any device, and every offset still fits a signed 64-bit integer


def parse_size(text: object) -> int:
    """Whole bytes, 1..MAX_SIZE; raises ValueError with the accepted forms for anything else.

    Exact decimal arithmetic: '1.5' bytes is refused (not rounded to 1), '1.5KiB' is 1536, and a
    400-digit number is "too large", not an OverflowError from float conversion.
    """
    m = _SIZE.fullmatch(str(text))
    if isinstance(text, bool) or not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 4096, 256KiB, 4MiB or 10GiB, got {text!r}")
    if len(m.group(1)) > 40:
        raise ValueError(f"expected a size of at most {MAX_SIZE} bytes (4 EiB), got {str(text)[:24]!r}...")
    try:
        exact = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    except InvalidOperation:  # pragma: no cover - the pattern admits only plain decimals
        raise ValueError(f"expected a size like 4096, 256KiB, 4MiB or 10GiB, got {text!r}") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"expected a whole number of bytes, got {text!r} (= {exact} bytes)")
    if not 1 <= exact <= MAX_SIZE:
        raise ValueError(f"expected a size from 1 byte to {MAX_SIZE} bytes (4 EiB), got {text!r}")
    return int(exact)
