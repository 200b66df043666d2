"""bench/compare_versions.py's pure part: figures collected from the benches' JSON, speed ratios in
the right direction (> 1 = after faster, for rates and for times), per-round spread, flags, the
settings check and the table. Fake results only: no bench runs, no processes."""

from __future__ import annotations

import copy

import pytest

from radixtier.testing.bench_scripts import load_bench

cv = load_bench("compare_versions")


def l3_result(radixtier: float, fio: float, write: float, pages: int = 4096) -> dict:
    """The shape bench/l3_bandwidth.py writes: two rows (a read and a write)."""
    return {"targets_vs_fio": {"reads": 0.95}, "reps": 3, "queue_depth": 16, "rows": [
        {"where": "ram-device", "part": "reads", "page_bytes": 65536,
         "gbps": {"radixtier": radixtier, "fio": fio, "raw": 5.0},
         "runs_gbps": {"radixtier": [radixtier] * 3, "fio": [fio] * 3, "raw": [5.0] * 3, "hicachefile": []},
         "vs_fio": radixtier / fio, "vs_raw": radixtier / 5.0, "pages": pages, "batch_pages": pages,
         "queue_depth": 16, "radixtier_info": {"io_engine": "io_uring", "direct_io": True, "corrupt": 0}},
        {"where": "ram-device", "part": "writes", "page_bytes": 4 << 20, "gbps": {"radixtier": write, "fio": 4.0},
         "runs_gbps": {"radixtier": [write], "fio": [4.0]}, "vs_fio": write / 4.0, "pages": 64, "batch_pages": 64,
         "queue_depth": 16, "radixtier_info": {"io_engine": "io_uring", "direct_io": True, "corrupt": 0}}]}


def tree_result(ours_ms: float, sglang_ms: float, matched: int = 32768) -> dict:
    """The shape bench/tree_ops.py writes (one op, one sweep size)."""
    stats = lambda p50: {"p50_ms": p50, "p10_ms": p50 * 0.8, "p90_ms": p50 * 1.5}  # noqa: E731
    return {"cached_tokens": 1 << 20, "request_tokens": 32768, "page_size": 16, "token_type": "array",
            "repeats": 100, "matched_prefix_tokens": {"match_full_hit": [matched]},
            "ops": {"match_full_hit": {"radixtier": stats(ours_ms), "sglang-sim": stats(sglang_ms),
                                       "sglang-paged": stats(sglang_ms),  # a copy, as tree_ops writes it
                                       "sglang-sim_over_radixtier": sglang_ms / ours_ms,
                                       "sglang-paged_over_radixtier": sglang_ms / ours_ms}},
            "scale": {"cached_tokens": [131072], "p50_ms": {"match_full_hit": {"radixtier": [ours_ms * 0.9]}},
                      "slope": {"match_full_hit": {"radixtier": 0.1}}}}


def runs_of(before: list, after: list) -> list:
    return [{"round": i + 1, "version": v, "result": res}
            for i, (b, a) in enumerate(zip(before, after)) for v, res in (("before", b), ("after", a))]


def by_name(cmp: dict) -> dict:
    return {r["metric"]: r for r in cmp["metrics"]}


def test_l3_rates_ratio_after_over_before_with_per_round_spread_and_flags():
    before = [l3_result(4.0, 5.0, 4.0), l3_result(4.2, 5.0, 4.0), l3_result(4.1, 5.0, 4.0)]
    after = [l3_result(3.0, 5.0, 4.4), l3_result(3.2, 5.1, 4.6), l3_result(3.1, 4.9, 4.4)]
    cmp = cv.compare("l3", runs_of(before, after), tolerance=0.05)
    m = by_name(cmp)
    reads = m["ram-device reads 64KiB radixtier"]
    assert (reads["unit"], reads["group"], reads["better"]) == ("GB/s", "radixtier", "higher")
    assert reads["before_median"] == pytest.approx(4.1) and reads["after_median"] == pytest.approx(3.1)
    assert reads["ratio"] == pytest.approx(3.1 / 4.1)
    assert (reads["ratio_min"], reads["ratio_max"]) == (pytest.approx(3.0 / 4.0), pytest.approx(3.2 / 4.2))
    assert reads["flag"] == "slower"
    assert m["ram-device writes 4MiB radixtier"]["flag"] == "faster"
    assert m["ram-device reads 64KiB fio"]["group"] == "reference" and m["ram-device reads 64KiB fio"]["flag"] == ""
    ratio = m["ram-device reads 64KiB radixtier/fio"]  # vs_fio, renamed: a ratio of ratios
    assert ratio["group"] == "relative" and ratio["ratio"] < 0.8 and ratio["flag"] == ""  # shown, not flagged
    assert "ram-device reads 64KiB radixtier/raw" in m
    assert cmp["noise"]["ram-device reads 64KiB"]["span"] == (pytest.approx(4.9 / 5.0), pytest.approx(5.1 / 5.0))
    assert cmp["noise"]["ram-device writes 4MiB"]["span"] == (1.0, 1.0)
    assert cmp["warnings"] == []  # the same work in both versions: no settings differ
    table = cv.format_table(cmp)
    assert "| ram-device reads 64KiB radixtier | GB/s | 4.10 | 3.10 | 0.76 | 0.75–0.76 | ±2% | slower |" in table
    text = "\n".join(cv.summary_lines(cmp))
    assert ("1 main radixtier figure(s) flagged slower (ratio beyond ±5% and beyond the noise, every round < 1): "
            "ram-device reads 64KiB radixtier (0.76).") in text
    assert "1 main radixtier figure(s) flagged faster" in text


def test_a_change_within_the_references_noise_is_not_flagged():
    # fio (the same code in both versions) moved by up to 30% between the rounds' runs: radixtier's
    # 25% is within that, though every round agrees and it is beyond the 5% tolerance
    before = [l3_result(4.0, 5.0, 4.0)] * 3
    after = [l3_result(3.0, 3.5, 4.0), l3_result(3.0, 6.5, 4.0), l3_result(3.0, 5.0, 4.0)]
    cmp = cv.compare("l3", runs_of(before, after), tolerance=0.05)
    assert cmp["noise"]["ram-device reads 64KiB"]["span"] == (pytest.approx(0.7), pytest.approx(1.3))
    assert cmp["noise"]["ram-device reads 64KiB"]["factor"] == pytest.approx(1 / 0.7)
    assert by_name(cmp)["ram-device reads 64KiB radixtier"]["ratio"] == pytest.approx(0.75)
    assert all(r.get("flag", "") == "" for r in cmp["metrics"])


def test_tree_times_ratio_before_over_after_so_above_one_is_faster():
    before = [tree_result(0.200, 0.300), tree_result(0.220, 0.300), tree_result(0.210, 0.300)]
    after = [tree_result(0.100, 0.310), tree_result(0.110, 0.290), tree_result(0.105, 0.300)]
    m = by_name(cv.compare("tree", runs_of(before, after)))
    ours = m["match_full_hit radixtier p50"]
    assert (ours["unit"], ours["better"], ours["level"]) == ("µs", "lower", "main")
    assert ours["before_median"] == pytest.approx(210.0) and ours["after_median"] == pytest.approx(105.0)
    assert ours["ratio"] == pytest.approx(2.0) and ours["flag"] == "faster"
    assert m["match_full_hit radixtier p90"]["level"] == "detail"
    assert m["sweep 128K cached: match_full_hit radixtier p50"]["ratio"] == pytest.approx(2.0)
    assert m["match_full_hit sglang-sim/radixtier"]["ratio"] > 1  # SGLang time / ours grew: after is better
    slope = m["slope match_full_hit radixtier"]
    assert slope["better"] == "delta" and slope["ratio"] == pytest.approx(0.0)
    # sglang-paged's matches are sglang-sim's figures copied (tree_ops times them once): reported once
    assert "match_full_hit sglang-sim p50" in m and "match_full_hit sglang-sim/radixtier" in m
    assert not any("sglang-paged" in name for name in m)


def test_different_work_between_versions_is_a_warning_and_a_missing_figure_has_no_ratio():
    before = [tree_result(0.2, 0.3, matched=32768)]
    after = [copy.deepcopy(tree_result(0.2, 0.3, matched=16384))]
    del after[0]["scale"]
    cmp = cv.compare("tree", runs_of(before, after))
    assert any(w.startswith("matched_prefix_tokens.match_full_hit differs") for w in cmp["warnings"])
    missing = by_name(cmp)["sweep 128K cached: match_full_hit radixtier p50"]
    assert missing["ratio"] is None and missing["after_median"] is None
    assert any("measured only in before" in w for w in cmp["warnings"])
    # one round: nothing is flagged (rounds cannot agree or disagree); nor with two (chance)
    assert all(r.get("flag", "") == "" for r in cmp["metrics"])
    assert "no flags" in "\n".join(cv.summary_lines(cmp))
    two = cv.compare("tree", runs_of([tree_result(0.2, 0.3)] * 2, [tree_result(0.4, 0.3)] * 2))
    assert by_name(two)["match_full_hit radixtier p50"]["ratio"] == 0.5
    assert all(r.get("flag", "") == "" for r in two["metrics"])


def test_bench_arguments_follow_the_defaults_and_out_is_refused():
    a, args = cv.parse_args(["l3", "--before", "/x", "--rounds", "2", "--sizes", "1MiB", "--", "--reps", "1"])
    assert a.rounds == 2 and a.before == "/x" and a.out.endswith("bench/results/compare_l3.json")
    assert args[:len(cv.BENCHES["l3"]["defaults"])] == cv.BENCHES["l3"]["defaults"]
    assert args[-4:] == ["--sizes", "1MiB", "--reps", "1"]
    _, args = cv.parse_args(["tree", "--before", "/x", "--replace-defaults", "--", "--repeats", "5"])
    assert args == ["--repeats", "5"]
    with pytest.raises(SystemExit):
        cv.parse_args(["tree", "--before", "/x", "--", "--out", "y.json"])


def test_each_figure_is_judged_against_the_noise_of_references_measured_alike():
    # the sweep (few repetitions) is noisier than the main operations: SGLang's sweep figure moved
    # by 40%, its main figure by 2%; radixtier's 25% is flagged in the main table, not in the sweep
    def result(ours: float, sglang_main: float, sglang_sweep: float) -> dict:
        res = tree_result(ours, sglang_main)
        res["scale"]["p50_ms"]["match_full_hit"] = {"radixtier": [ours], "sglang-sim": [sglang_sweep]}
        return res

    before = [result(0.100, 0.300, 0.300)] * 3
    after = [result(0.125, 0.306, 0.420), result(0.125, 0.300, 0.300), result(0.125, 0.300, 0.300)]
    cmp = cv.compare("tree", runs_of(before, after))
    m = by_name(cmp)
    assert cmp["noise"]["match_full_hit"]["factor"] == pytest.approx(0.306 / 0.300)
    assert cmp["noise"]["sweep 128K: match_full_hit"]["factor"] == pytest.approx(0.420 / 0.300)
    assert m["match_full_hit radixtier p50"]["flag"] == "slower"
    assert m["sweep 128K cached: match_full_hit radixtier p50"]["ratio"] == pytest.approx(0.8)
    assert m["sweep 128K cached: match_full_hit radixtier p50"]["flag"] == ""


def test_an_outlier_in_another_measurement_does_not_make_every_change_noise():
    # SGLang's paged evict sometimes takes 10 ms instead of 0.1 (its allocator): that reference
    # jumping 100x in one round makes evict's figures noise, not a 25% slowdown of the matches
    def result(ours: float, evict_ref: float, evict_ours: float = 0.02) -> dict:
        res = tree_result(ours, 0.300)
        res["ops"]["evict_32k"] = {"radixtier": {"p50_ms": evict_ours}, "sglang-paged": {"p50_ms": evict_ref}}
        return res

    before = [result(0.100, 10.0), result(0.100, 0.1), result(0.100, 0.1)]
    after = [result(0.125, 0.1, 0.03), result(0.125, 0.1, 0.03), result(0.125, 0.1, 0.03)]
    cmp = cv.compare("tree", runs_of(before, after))
    assert cmp["noise"]["evict_32k"]["span"][1] == pytest.approx(100.0)
    assert cmp["noise"]["match_full_hit"]["factor"] == 1.0
    m = by_name(cmp)
    assert m["match_full_hit radixtier p50"]["flag"] == "slower"
    assert m["evict_32k radixtier p50"]["ratio"] == pytest.approx(2 / 3) and m["evict_32k radixtier p50"]["flag"] == ""
    assert "| ×100 |" in cv.format_table(cmp)
