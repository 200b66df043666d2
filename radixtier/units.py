"""Byte sizes as operators write them ('4096', '256KiB', '4MiB', '2TB'), for the CLI and configs."""

from __future__ import annotations

import re

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: object) -> int:
    """Bytes; raises ValueError with the accepted forms for anything else."""
    m = _SIZE.fullmatch(str(text))
    if isinstance(text, bool) or not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like 4096, 256KiB, 4MiB or 10GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
