"""Percentiles for the demos' and benches' latency figures: one definition, so every p50/p99 printed
by `radixtier demo` (either engine) and the benches means the same thing."""

from __future__ import annotations

from typing import Sequence


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile by linear interpolation between the two nearest ranks (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(len(xs) - 1, int(k) + 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
