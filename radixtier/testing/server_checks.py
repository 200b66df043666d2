"""Checks the real-server tests share (tests/test_sglang_server.py, tests/test_sglang_hybrid.py):
a failed assertion carries the servers' logs; a workload cold and after /flush_cache; tokens SGLang
reports from storage; greedy outputs compared with the same server without L3."""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator

from radixtier.demo import http_load
from radixtier.integrations.sglang.launch.server import SGLangServer

LOGPROB_TOL = 0.01


@contextlib.contextmanager
def explained(*servers: SGLangServer) -> Iterator[None]:
    """An assertion that fails carries the servers' log tails."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n" + "\n".join(s.log_tail(40) for s in servers)) from None


def passes(s: SGLangServer, workload) -> Dict[str, http_load.Run]:
    """The workload cold, then again after /flush_cache (device and host emptied; tier 3 kept)."""
    cold = http_load.replay(s.url, workload)
    s.flush_cache()
    return {"cold": cold, "flushed": http_load.replay(s.url, workload)}


def storage_tokens(run: http_load.Run) -> int:
    return sum(r.cached.get("storage", 0) for r in run.replies)


def same_outputs(reference_run: http_load.Run, run: http_load.Run, tol: float = LOGPROB_TOL) -> None:
    """Output tokens equal, per-token logprobs within `tol`, or AssertionError listing the differences."""
    bad = http_load.compare(reference_run, run, tol)
    assert not bad, "outputs differ from the server without L3:\n" + "\n".join(bad[:10])


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples (over label sets) whose labels include `labels` (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def wait_for_backups(s: SGLangServer, at_least: float = 1, timeout_s: float = 60) -> float:
    """Pages tier 3 holds, once SGLang's backup thread has written at least `at_least` and the count
    held still over a second (a backup follows its request's write-through within milliseconds);
    fails the test after timeout_s."""
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        seen.append(metric(s.metrics(), "radixtier:storage_used_pages"))
        if seen[-1] >= at_least and len(seen) >= 5 and len(set(seen[-5:])) == 1:
            return seen[-1]
        time.sleep(0.25)
    raise AssertionError(f"tier 3 did not settle at >= {at_least} pages within {timeout_s} s: {seen[-10:]}")
