"""`radixtier plan`: the cost model's arithmetic, its inputs (HF configs, flags, measurement) and errors."""

from __future__ import annotations

import json

import pytest

from radixtier.cli import main as cli_main
from radixtier.costmodel import Inputs, KVGeometry, predict, verdict


def test_kv_bytes_per_token_from_hf_configs(tmp_path):
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                 "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    assert KVGeometry.from_hf_config(str(llama)).bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB, Llama-3-8B
    ds = tmp_path / "deepseek.json"
    ds.write_text(json.dumps({"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
                              "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16"}))
    g = KVGeometry.from_hf_config(str(ds))
    assert g.attention == "MLA" and g.bytes_per_token() == 61 * 576 * 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="^config: .* lacks a field"):
        KVGeometry.from_hf_config(str(bad))


def test_the_model_by_hand():
    g = KVGeometry(layers=1, kv_heads=1, head_dim=500, dtype_bytes=1)  # 1000 bytes per token
    inp = Inputs(context_tokens=10_000, hit_rate=0.9, concurrency=1, prefill_tps=1000.0, local_gbps=0.001,
                 tier_gbps=0.01, net_gbps=0.005)
    p = predict(g, inp)
    rec, local, tier = (p["paths"][k] for k in ("recompute", "local_nvme", "tiered_nvmeof"))
    assert rec["ttft_s"] == pytest.approx(10.0)  # 10,000 tokens at 1,000 tokens/s
    assert local["compute_s"] == pytest.approx(1.0) and local["load_s"] == pytest.approx(9.0)  # 9 MB at 1 MB/s
    assert tier["load_s"] == pytest.approx(1.8)  # the 5 MB/s network caps the 10 MB/s target
    assert tier["bottleneck"] == "network" and local["bottleneck"] == "storage bandwidth"
    assert p["breakeven_gbps"] == pytest.approx(0.001)  # 1000 B/token x 1000 tokens/s
    inp.concurrency = 4  # queueing: 3 x the slower stage, then the request's own compute + load
    assert predict(g, inp)["paths"]["tiered_nvmeof"]["ttft_s"] == pytest.approx(3 * 1.8 + 1.0 + 1.8)
    assert p["tiering_pays_off"] and "pays off" in verdict(p)


def test_slow_storage_says_recompute():
    p = predict(KVGeometry(80, 8, 128), Inputs(32768, 0.9, 8, prefill_tps=50_000, tier_gbps=1.0, net_gbps=1.0))
    assert not p["tiering_pays_off"] and "slower than computing it" in verdict(p)


def test_cli_prints_measures_and_plots(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert cli_main(["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "8192",
                     "--measure", str(tmp_path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "measured:" in out and "tiered_nvmeof" in out and "bottleneck" in out and png.stat().st_size > 10_000
    assert list(tmp_path.iterdir()) == [png]  # the measurement's namespace is removed
    assert cli_main(["plan", "--layers", "32", "--mla-dim", "576", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "MLA"


@pytest.mark.parametrize("args, message", [
    (["--hit-rate", "1.5", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"],
     "--hit-rate: expected a number from 0 to 1, got '1.5'"),
    (["--concurrency", "0", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"],
     "--concurrency: expected a whole number"),
    (["--tier-gbps", "0", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"],
     "--tier-gbps: expected a number from 1e-06"),
    ([], "config: give --config"),
])
def test_bad_options_get_one_line_errors(args, message, capsys):
    assert cli_main(["plan"] + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field, value", [
    ("prefill_overhead_s", float("nan")), ("prefix_cost_s_per_token", float("inf")), ("tier_gbps", float("inf")),
    ("context_tokens", 10 ** 400), ("concurrency", True), ("hit_rate", float("nan"))])
def test_the_api_refuses_inputs_the_arithmetic_cannot_survive(field, value):
    """predict() checks its Inputs itself: NaN, inf and huge numbers never reach the arithmetic."""
    inp = Inputs(32768, 0.9, 8, prefill_tps=20000.0)
    setattr(inp, field, value)
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        predict(KVGeometry(2, 1, 8), inp)


def test_config_fields_are_checked_by_name(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 0, "hidden_size": 4096}))
    with pytest.raises(ValueError, match=r"^config: .*: num_attention_heads: expected a whole number .* got 0$"):
        KVGeometry.from_hf_config(str(cfg))
    cfg.write_text(json.dumps({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                                               "num_key_value_heads": None, "head_dim": None}}))
    assert KVGeometry.from_hf_config(str(cfg)) == KVGeometry(2, 4, 16, 2)  # null fields take HF's defaults


def test_write_file_removes_a_partial_file(tmp_path, monkeypatch):
    from radixtier import costmodel as plan

    out = tmp_path / "plot.png"
    real_open = open

    class Short:
        """A raw file whose writes stop after 10 bytes (a full disk)."""

        def __init__(self, f):
            self.f, self.n = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, view):
            n = min(len(view), 10 - self.n)
            self.n += n
            return self.f.write(view[:n]) if n else 0

    monkeypatch.setattr("builtins.open", lambda p, *a, **k: Short(real_open(p, *a, **k)))
    with pytest.raises(ValueError, match=r"^--png: cannot write .*plot.png \(the write stopped after 10 of 100 "):
        plan.write_file("--png", str(out), bytes(100))
    assert not out.exists()


def test_every_corner_of_the_ranges_gives_a_finite_prediction():
    """The Ranges' promise: at their corners (the extremes the CLI lets through) every TTFT,
    throughput and ratio is a finite float > 0 -- no overflow, no division by zero, no NaN verdict."""
    import itertools
    import math

    from radixtier.costmodel import COUNT, RATE, SECONDS, SECONDS_PER_TOKEN, format_report

    big = COUNT.high
    for g in (KVGeometry(1, 1, 1, 1), KVGeometry(big, big, big, 8), KVGeometry(big, dtype_bytes=8, mla_dim=big)):
        for values in itertools.product((1, big), (0.0, 1.0), (1, big), (RATE.low, RATE.high), (0.0, SECONDS.high),
                                        (0.0, SECONDS_PER_TOKEN.high), (RATE.low, RATE.high), (RATE.low, RATE.high),
                                        (RATE.low, RATE.high)):
            p = predict(g, Inputs(*values))
            format_report(p)
            ratios = [p["tiered_vs_recompute_ttft"], p["tiered_vs_local_ttft"], p["tiered_vs_local_throughput"]]
            for r in p["paths"].values():
                ratios += [r["ttft_s"], r["throughput_rps"]]
            assert all(math.isfinite(x) and x > 0 for x in ratios), (g, values)
