"""The toy model's dtype: bf16 only where the CPU computes it natively, fp32 elsewhere, and SGLang's
server is told which (its `auto` would turn an fp32 config into bf16 or fp16)."""

from __future__ import annotations

import pytest

from radixtier.native_dtype import cpu_flags, native_dtype, resolve_dtype

AVX2_EPYC = frozenset("fpu sse sse2 avx avx2 fma f16c bmi2".split())
ZEN4_EPYC = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "amx_tile", "amx_bf16"}


def test_bf16_only_with_avx512_bf16_or_amx():
    assert native_dtype(AVX2_EPYC, "")[0] == "float32"
    assert "no native bf16" in native_dtype(AVX2_EPYC, "")[1]
    assert native_dtype(ZEN4_EPYC, "") == ("bfloat16", "the CPU computes bf16 natively (avx512_bf16)")
    assert native_dtype(SAPPHIRE_RAPIDS, "")[0] == "bfloat16"
    assert native_dtype(frozenset(), "")[0] == "float32"  # flags unreadable: the safe choice


@pytest.mark.parametrize("cap, dtype", [("AVX2", "float32"), ("avx512_core", "float32"), ("AVX512_CORE_VNNI", "float32"),
                                        ("AVX512_CORE_BF16", "bfloat16"), ("avx512_core_amx", "bfloat16"),
                                        ("ALL", "bfloat16")])
def test_a_onednn_isa_cap_below_bf16_counts_as_no_native_bf16(cap, dtype):
    got, why = native_dtype(ZEN4_EPYC, cap)
    assert got == dtype
    if dtype == "float32":
        assert "ONEDNN_MAX_CPU_ISA" in why


def test_the_environment_cap_is_read(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert native_dtype(ZEN4_EPYC)[0] == "float32"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert native_dtype(ZEN4_EPYC)[0] == "bfloat16"


def test_cpu_flags_reads_proc_cpuinfo_and_survives_its_absence(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_resolve_dtype_takes_auto_or_a_name_and_refuses_the_rest_by_name():
    assert resolve_dtype("float32") == ("float32", "as asked")
    assert resolve_dtype("auto")[0] in ("float32", "bfloat16")
    with pytest.raises(ValueError, match=r"^dtype: expected auto, bfloat16 or float32, got 'fp8\\x1b\[31m'$"):
        resolve_dtype("fp8\x1b[31m")


def test_sglangs_cpu_server_is_told_the_dtype(tmp_path):
    from radixtier.integrations.sglang.launch.server import SGLangServer

    s = SGLangServer(str(tmp_path), ["--page-size", "64"], log_path=str(tmp_path / "log"), dtype="float32")
    cmd = s.command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    own = SGLangServer(str(tmp_path), ["--dtype", "bfloat16"], log_path=str(tmp_path / "log"), dtype="float32")
    assert own.command().count("--dtype") == 1  # the caller's own --dtype wins
    cuda = SGLangServer(str(tmp_path), [], log_path=str(tmp_path / "log"), device="cuda")
    assert "--dtype" not in cuda.command()  # on a GPU SGLang chooses, as it does for users
