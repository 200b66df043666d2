"""bench/router_gain.py: its fleet model (pure parts) and one small replay through Dynamo's indexer."""

from __future__ import annotations

import json

import pytest

from radixtier.testing.bench_scripts import load_bench
from radixtier.testing.skips import require_sglang

require_sglang("sglang.srt.disaggregation.kv_events")

rg = load_bench("router_gain")


def test_pages_chain_like_sglangs_keys_and_share_a_common_prefix():
    a = rg.chain(list(range(1000, 1000 + 3 * rg.PAGE)) + [7])        # a partial last page is not a page
    b = rg.chain(list(range(1000, 1000 + 2 * rg.PAGE)) + [5] * rg.PAGE)
    assert len(a) == 3 and [p.key for p in a[:2]] == [p.key for p in b[:2]] and a[2].key != b[2].key
    assert len({p.block for p in a}) == 3


def test_a_tier_evicts_leaves_before_their_parents():
    tier = rg.LruPages(capacity=4)
    first = rg.chain(list(range(1000, 1000 + 3 * rg.PAGE)))
    other = rg.chain(list(range(5000, 5000 + 3 * rg.PAGE)))
    new, evicted = tier.touch(first)
    assert new == first and evicted == []
    new, evicted = tier.touch(other)
    assert evicted == [first[2], first[1]]  # the first chain's leaves go, its root stays
    assert first[0].key in tier.pages


def test_fresh_pages_group_into_runs_with_their_parents():
    pages = rg.chain(list(range(1000, 1000 + 5 * rg.PAGE)))
    fresh = {pages[1].key, pages[2].key, pages[4].key}
    assert [([p.key for p in run], parent) for run, parent in rg.runs(pages, fresh)] == \
        [([pages[1].key, pages[2].key], pages[0].key), ([pages[4].key], pages[3].key)]


def test_the_agent_fleet_grows_each_agents_prompt_from_its_system_prompt():
    prompts = rg.agent_fleet(agent_types=2, agents_per_type=2, steps=3, system_pages=2, step_pages=1, seed=1)
    assert len(prompts) == 12
    assert sorted({len(p) for p in prompts}) == [3 * rg.PAGE, 4 * rg.PAGE, 5 * rg.PAGE]
    assert len({tuple(p[:2 * rg.PAGE]) for p in prompts}) == 2  # two system prompts


def test_a_small_replay_routes_through_dynamo_and_tier3_never_costs_recompute(tmp_path):
    from radixtier.testing.skips import require_dynamo

    require_dynamo()
    out = tmp_path / "rg.json"
    # 9 system prompts of 512 tokens, device+host of 16 pages a node: system prompts leave device and host
    assert rg.main(["--nodes", "3", "--agent-types", "9", "--agents-per-type", "1", "--steps", "3",
                    "--system-pages", "8", "--step-pages", "1", "--fast-pages", "16", "--tier3-pages", "512",
                    "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    seen, blind = report["fleets"]["tier 3 seen"], report["fleets"]["device only"]
    assert seen["requests"] == blind["requests"] == 27
    for r in (seen, blind):
        assert r["tokens_device_host"] + r["tokens_tier3"] + r["tokens_computed"] == r["prompt_tokens"]
        assert r["known_holder_device_host"] <= r["known_holder_any_tier"]
    assert seen["to_prefix_holder"] == 27 - 9  # every request but each system prompt's first visit
    assert seen["known_holder_any_tier"] > seen["known_holder_device_host"]  # Dynamo knew of tier-3 holders
    assert blind["known_holder_any_tier"] == blind["known_holder_device_host"]
    assert seen["tokens_computed"] < blind["tokens_computed"]
    assert (tmp_path / "rg.md").read_text().startswith("Agent fleet:") and (tmp_path / "rg.png").stat().st_size > 0
    # node 0 restarts after half the requests: re-announcing its tier 3 wins back what it holds
    again, silent = (report["fleets"][f]["after_restart"] for f in ("restart, re-announced", "restart, not re-announced"))
    assert again["requests"] == silent["requests"] == 27 - report["restart_at"]
    assert again["restarted_tier3_tokens"] > silent["restarted_tier3_tokens"]
    assert again["tokens_computed"] < silent["tokens_computed"]
    assert "| re-announced |" in (tmp_path / "rg.md").read_text()


def test_bad_numbers_are_refused_by_name():
    with pytest.raises(SystemExit):
        rg.main(["--nodes", "0"])
    with pytest.raises(SystemExit):
        rg.main(["--restart-at", "1.5"])
