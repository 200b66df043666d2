"""A minimal serving loop that measures TTFT: clients, one model worker, and a KV path.

Clients send each session's requests in order (closed loop, `concurrency` clients at once);
a single worker runs prefill FIFO, as a scheduler with batch size 1 would. The KV path decides
what is reused: nothing (recompute), or a prefix served through a TieredKVCache. Prefetch
starts for the next `prefetch_window` queued requests while the worker computes the current
one, so tier-3 reads overlap queueing and other requests' compute: that overlap, and parallel
reads, are where tiering wins its time back. The window is bounded because a prefetched
prefix is pinned in the host and device tiers until its request runs: prefetching every
queued request would pin more than the tiers hold and starve the request at the head.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from radixtier.cache import TieredKVCache
from radixtier.policies import PrefetchPolicy
from radixtier.tiers import Tier
from radixtier.demo.stats import percentile
from radixtier.demo.toymodel import ToyLlama
from radixtier.demo.workloads import Request, Session


@dataclass
class RequestResult:
    session: str
    turn: int
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float
    first_token: int
    hits: Dict[str, int] = field(default_factory=dict)


@dataclass
class Loaded:
    """What a KV path found for a request: the reusable prefix pages (or None) and where they came from."""

    handle: object
    pages: Optional[torch.Tensor]
    hits: Dict[str, int] = field(default_factory=dict)


class RecomputePath:
    """No KV reuse: every request prefills its whole prompt."""

    name = "recompute"

    def on_arrival(self, tokens: List[int]):
        return None

    def load(self, ctx, tokens: List[int]) -> Loaded:
        return Loaded(None, None)

    def save(self, loaded: Loaded, tokens: List[int], pages: torch.Tensor, first_page: int) -> None:
        pass

    def finish(self, loaded: Loaded) -> None:
        pass


class TieredPath:
    """Prefix reuse through a TieredKVCache; `prefetch_on_arrival=False` reads in the critical path.

    `model_page_shape`: when cache pages carry more than the model reads (the benchmark's
    emulated KV size), only the leading elements of that shape are gathered for the model.
    """

    def __init__(self, cache: TieredKVCache, name: str = "radixtier", prefetch_on_arrival: bool = True,
                 policy: str = PrefetchPolicy.WAIT_COMPLETE,
                 model_page_shape: Optional[Tuple[int, ...]] = None) -> None:
        self.cache, self.name = cache, name
        self.prefetch_on_arrival, self.policy = prefetch_on_arrival, policy
        self.model_page_shape = tuple(model_page_shape) if model_page_shape else None

    def on_arrival(self, tokens: List[int]):
        return self.cache.prefetch(tokens) if self.prefetch_on_arrival else None

    def load(self, ctx, tokens: List[int]) -> Loaded:
        ps = self.cache.config.page_size
        h = ctx if ctx is not None else self.cache.prefetch(tokens)
        if ctx is not None and self.cache.match(tokens, beyond_memory=False).prefix_tokens > h.planned_pages * ps:
            # Requests that ran while this one waited cached more of its prefix (a shared system
            # prompt, say): plan again at schedule time, as SGLang's scheduler matches then.
            fresh = self.cache.prefetch(tokens)  # joins the old plan's in-flight promotions
            h.release()
            h = fresh
        r = h.load(self.policy)
        usable = min(r.num_pages, (len(tokens) - 1) // ps)  # at least one token must still run
        hits: Dict[str, int] = {}
        left = usable * ps
        for tier in (Tier.DEVICE, Tier.HOST, Tier.STORAGE, Tier.REMOTE):
            take = min(left, r.hits_by_tier.get(tier, 0))
            if take:
                hits[tier.label] = take
            left -= take
        pages = None
        if usable and self.model_page_shape is None:
            pages = self.cache.gather(r.device_slots[:usable])
        elif usable:
            head = 1
            for d in self.model_page_shape:
                head *= d
            # pages carry more bytes than the toy model reads (emulated KV size): use each page's head
            pages = self.cache.gather(r.device_slots[:usable]).reshape(usable, -1)[:, :head]
            pages = pages.reshape((usable,) + self.model_page_shape)
        return Loaded(h, pages, hits)

    def save(self, loaded: Loaded, tokens: List[int], pages: torch.Tensor, first_page: int) -> None:
        if pages.shape[0]:
            self.cache.insert(tokens, pages, first_page=first_page)

    def finish(self, loaded: Loaded) -> None:
        loaded.handle.release()


def serve(model: ToyLlama, path, sessions: List[Session], concurrency: int,
          on_done: Optional[Callable[[RequestResult], None]] = None,
          prefetch_window: int = 2) -> Tuple[List[RequestResult], float]:
    """Run the workload; returns per-request results and the wall time."""
    if concurrency <= 0:
        raise ValueError(f"concurrency: expected a positive integer, got {concurrency!r}")
    if prefetch_window < 0:
        raise ValueError(f"prefetch_window: expected a non-negative integer, got {prefetch_window!r}")
    waiting: "collections.deque[_Queued]" = collections.deque()
    cv = threading.Condition()
    stop = [False]
    results: List[RequestResult] = []
    errors: List[BaseException] = []
    lock = threading.Lock()
    ps = model.page_size

    def next_item() -> Optional["_Queued"]:  # only the worker thread pops and prefetches
        with cv:
            cv.wait_for(lambda: waiting or stop[0])
            if not waiting:
                return None
            item = waiting.popleft()
            ahead = [q for q in list(waiting)[:prefetch_window] if not q.started]
            for q in ahead:
                q.started = True
        if not item.started:
            item.started = True
            item.ctx = path.on_arrival(item.req.tokens)
        for q in ahead:  # head start for the next requests, overlapping this one's compute
            q.ctx = path.on_arrival(q.req.tokens)
        return item

    def worker() -> None:
        while True:
            item = next_item()
            if item is None:
                return
            req = item.req
            try:
                loaded = path.load(item.ctx, req.tokens)
                reused = 0 if loaded.pages is None else loaded.pages.shape[0]
                if reused and not model.worth_reusing(reused * ps, len(req.tokens)):
                    loaded.pages, loaded.hits, reused = None, {}, 0  # recomputing is faster for this model
                first, new = model.prefill(req.tokens, loaded.pages)
                ttft = time.perf_counter() - item.arrival
                path.save(loaded, req.tokens, new, reused)
                path.finish(loaded)
                item.box.append(RequestResult(req.session, req.turn, len(req.tokens), reused * ps, ttft, first,
                                              loaded.hits))
            except BaseException as exc:  # reported to the client thread
                item.box.append(exc)
            finally:
                item.done.set()

    def client(my_sessions: List[Session]) -> None:
        # A client's users take turns (turn 0 of each session, then turn 1, ...), as chat users
        # interleave: a session's next turn comes after the others have pushed its KV down-tier.
        longest = max((len(x) for x in my_sessions), default=0)
        interleaved = [sess[t] for t in range(longest) for sess in my_sessions if t < len(sess)]
        for req in interleaved:
            item = _Queued(req, time.perf_counter())
            with cv:
                waiting.append(item)
                cv.notify_all()
            item.done.wait()
            res = item.box[0]
            if isinstance(res, BaseException):
                errors.append(res)
                return
            with lock:
                results.append(res)
            if on_done is not None:
                on_done(res)

    w = threading.Thread(target=worker, name="radixtier-model", daemon=True)
    w.start()
    buckets: List[List[Session]] = [sessions[i::concurrency] for i in range(concurrency)]
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, args=(b,), daemon=True) for b in buckets if b]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    wall = time.perf_counter() - t0
    with cv:
        stop[0] = True
        cv.notify_all()
    w.join()
    if errors:
        raise errors[0]
    return results, wall


class _Queued:
    """A request waiting for the model worker, with its prefetch handle once one is started."""

    def __init__(self, req: Request, arrival: float) -> None:
        self.req, self.arrival = req, arrival
        self.ctx = None
        self.started = False
        self.box: list = []
        self.done = threading.Event()


def summarize(results: List[RequestResult], wall: float) -> Dict[str, object]:
    ttfts = [r.ttft_s for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    reused = sum(r.reused_tokens for r in results)
    by_tier: Dict[str, int] = {}
    for r in results:
        for k, v in r.hits.items():
            by_tier[k] = by_tier.get(k, 0) + v
    return {
        "requests": len(results), "wall_s": wall, "prompt_tokens": prompt,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
        "throughput_rps": len(results) / wall if wall else 0.0,
        "prompt_tokens_per_s": prompt / wall if wall else 0.0,
        "hit_rate": reused / prompt if prompt else 0.0,
        "hit_tokens_by_tier": by_tier,
    }
