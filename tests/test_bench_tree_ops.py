"""bench/tree_ops.py compares like with like: every engine finds the same prefix for each timed
match (a small cache, a few repetitions; nothing here is timed)."""

from __future__ import annotations

import argparse

import pytest

from radixtier.testing.bench_scripts import load_bench
from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.mem_cache.radix_cache")
tree_ops = load_bench("tree_ops")

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("token_type", ["array", "list"])
def test_every_engine_matches_the_same_prefix_and_every_operation_is_timed(token_type):
    args = argparse.Namespace(page_size=16, request_tokens=1024, shared_prefix=256, token_type=token_type)
    times = tree_ops.measure(4 * 1024, args, repeats=4, progress=False)
    matched = times.pop("_matched")
    # one value per operation: radixtier and both SGLang caches found the same prefix every time
    assert matched == {"match_full_hit": [1024], "match_half_hit": [512], "match_miss": [0]}
    for op in tree_ops.OPS:
        timed_engines = ("radixtier", "sglang-sim") if op.startswith("match") else tree_ops.ENGINES
        for engine in timed_engines:
            assert len(times[op][engine]) == 4, (op, engine)
