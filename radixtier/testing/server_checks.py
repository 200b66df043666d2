"""Checks the real-server tests share (tests/test_sglang_server.py, tests/test_sglang_hybrid.py):
a failed assertion carries the servers' logs; a workload cold and after /flush_cache; tokens SGLang
reports from storage; greedy outputs compared with the same server without L3."""

from __future__ import annotations

import contextlib
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
