"""bench/fleet_model.py's model: the pure functions only (no Redis, no ZMQ, nothing timed)."""

from __future__ import annotations

import pytest

from radixtier.testing.bench_scripts import load_bench

fm = load_bench("fleet_model")

INPUTS = dict(nodes=1000, pages=100e6, requests_per_s=10_000, pages_per_request=32, new_pages_per_request=8,
              write_pages_per_s=None, shard_memory_gib=64, usable_memory=0.75)
MEASURED = dict(bytes_per_record=600.0, chain_pages=64, lookups_per_s=20_000.0, publish_records_per_s=100_000.0,
                unpublish_records_per_s=200_000.0, subscriber_events_per_s=100_000.0,
                stored_bytes={1: 141, 64: 710}, stored_bytes_tokens={1: 399, 64: 17506}, removed_bytes={1: 83, 64: 652})


def test_shards_needed_rounds_up_and_is_at_least_one():
    assert fm.shards_needed(10, 5) == 2
    assert fm.shards_needed(10.01, 5) == 3
    assert fm.shards_needed(0, 5) == 1
    assert fm.shards_needed(0.3 + 0.6 + 0.1, 1.0) == 1  # float noise does not add a shard
    with pytest.raises(ValueError, match="per-shard capacity"):
        fm.shards_needed(1, 0)


def test_verdict_picks_the_largest_load():
    first, ranked = fm.verdict({"memory": 1.2, "lookup rate": 3.5, "write rate": 0.4, "event stream": 0.1})
    assert first == "lookup rate"
    assert [k for k, _ in ranked] == ["lookup rate", "memory", "write rate", "event stream"]
    with pytest.raises(ValueError):
        fm.verdict({})


@pytest.mark.parametrize("name,value,option", [
    ("nodes", 0, "--nodes"), ("pages", -1, "--pages"), ("requests_per_s", float("nan"), "--requests-per-s"),
    ("pages_per_request", 2.5, "--pages-per-request"), ("shard_memory_gib", "x", "--shard-memory-gib"),
    ("write_pages_per_s", 0, "--write-pages-per-s"), ("usable_memory", 1.5, "--usable-memory"),
    ("new_pages_per_request", 64, "--new-pages-per-request")])
def test_bad_inputs_are_refused_in_one_line_naming_the_option(name, value, option):
    with pytest.raises(ValueError) as err:
        fm.validate_inputs({**INPUTS, name: value})
    assert str(err.value).startswith(option + ":") and "\n" not in str(err.value)


def test_write_rate_defaults_to_requests_times_new_pages():
    assert fm.validate_inputs(INPUTS)["write_pages_per_s"] == 80_000
    assert fm.validate_inputs({**INPUTS, "write_pages_per_s": 5000})["write_pages_per_s"] == 5000


def test_event_bytes_interpolate_between_the_measured_sizes():
    assert fm.event_bytes({1: 100, 65: 740}, 1) == 100
    assert fm.event_bytes({1: 100, 65: 740}, 65) == 740
    assert fm.event_bytes({1: 100, 65: 740}, 33) == 420


def test_lookup_capacity_is_per_call_up_to_the_measured_chain_and_per_page_beyond():
    assert fm.lookup_capacity(1000, 64, 32) == 1000
    assert fm.lookup_capacity(1000, 64, 128) == 500


def test_the_model_extrapolates_the_fleet():
    m = fm.model(INPUTS, MEASURED)
    assert m["index_bytes"] == 100e6 * 600
    assert m["shards"]["memory"] == 2  # 55.9 GiB over 48 GiB usable per shard
    assert m["shards"]["lookup rate"] == 1
    assert m["loads"]["write rate"] == pytest.approx(80_000 / 100_000 + 80_000 / 200_000)
    assert m["shards"]["write rate"] == 2
    assert m["shards"]["lookups + writes (one CPU)"] == 2  # 0.5 + 1.2
    assert m["events_per_s"] == 20_000  # 10k BlockStored + 10k BlockRemoved of 8 blocks
    assert m["subscribers"] == 1
    assert m["saturates_first"] == "write rate"
    assert fm.redis_shards(m) == 2
    lines = fm.conclusions(m)
    assert lines[0].startswith("saturates first: write rate") and "one router keeps up" in lines[-1]


def test_a_faster_fleet_saturates_the_event_stream_and_needs_more_routers():
    m = fm.model({**INPUTS, "requests_per_s": 1e6, "pages": 1e6}, {**MEASURED, "lookups_per_s": 1e9,
                                                                    "publish_records_per_s": 1e9,
                                                                    "unpublish_records_per_s": 1e9})
    assert m["saturates_first"] == "event stream" and m["subscribers"] == 20
    assert "20 routers" in fm.conclusions(m)[-1]
