"""Which floating-point dtype this CPU computes natively: the toy model's dtype for the demo, tests and benches.

A CPU with AVX-512 BF16 or AMX runs bf16 matrix products in hardware (on a 2-core AMD EPYC with
AVX-512 BF16, a 3,000 x 256 x 16,384 product took 0.13 s in bf16 against 0.42 s in fp32); one with
AVX2 only converts every bf16 element in software, and bf16 prefill of the toy model ran about 4x
slower than fp32 on a 2-core AVX2-only EPYC (2,300 against 600 ms for a 3,000-token prompt). The
toy model therefore computes in bf16 where the CPU has it and in fp32 elsewhere.

`ONEDNN_MAX_CPU_ISA` caps the instructions oneDNN (torch's CPU matmul library) may use; capped
below AVX-512 BF16, bf16 products fall back to a slow reference path (measured: 75x fp32), so a cap
counts as no native bf16. Reads /proc/cpuinfo only: no torch import.
"""

from __future__ import annotations

import os
from typing import FrozenSet, Optional, Tuple

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) that still include AVX-512 BF16 or AMX
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
              "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
              "ALL", "DEFAULT")
DTYPES = ("bfloat16", "float32")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> FrozenSet[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo cannot be read, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_dtype(flags: Optional[FrozenSet[str]] = None, max_isa: Optional[str] = None) -> Tuple[str, str]:
    """("bfloat16" | "float32", why): bf16 where the CPU has AVX-512 BF16 or AMX and oneDNN may use it.

    flags: the CPU's feature flags (default: /proc/cpuinfo's); max_isa: oneDNN's ISA cap (default:
    $ONEDNN_MAX_CPU_ISA). Never raises.
    """
    flags = cpu_flags() if flags is None else flags
    max_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") if max_isa is None else max_isa
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        return "float32", "the CPU has no native bf16 (no AVX-512 BF16, no AMX)"
    if max_isa and max_isa.strip().upper() not in _BF16_ISAS:
        return "float32", f"ONEDNN_MAX_CPU_ISA={max_isa[:40]!r} keeps oneDNN from the CPU's bf16 instructions"
    return "bfloat16", f"the CPU computes bf16 natively ({', '.join(have)})"


def resolve_dtype(requested: str) -> Tuple[str, str]:
    """`auto` -> native_dtype(); `bfloat16` / `float32` as asked. ValueError naming `dtype` otherwise."""
    if requested == "auto":
        return native_dtype()
    if requested in DTYPES:
        return requested, "as asked"
    raise ValueError(f"dtype: expected auto, bfloat16 or float32, got {requested[:40]!r}")
