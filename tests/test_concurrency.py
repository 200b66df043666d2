"""Serving threads match/acquire/insert while movers spill and promote underneath them."""

from __future__ import annotations

import random
import threading

import pytest

from radixtier.storage.nvmeof.store import NvmeofPageStore
from radixtier.tiers import Tier

from radixtier.testing.cache import NUMEL, check_prefix, kv_for, make_cache


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_stress_serving_threads_with_movers(ns4, ns_file, policy):
    store = NvmeofPageStore(ns_file, NUMEL * 4, create_bytes=2 << 20)  # ~120 slots: tier 3 also fills
    cache = make_cache(ns4, store, device_pages=24, host_pages=48, write_policy=policy,
                       write_through_threshold=2, promote_chunk_pages=4, io_workers=3)
    rng = random.Random(7)
    systems = [[rng.randrange(1000) for _ in range(rng.choice([8, 16, 24]))] for _ in range(4)]
    errors = []
    served = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(60):
                tokens = r.choice(systems) + [r.randrange(1000) for _ in range(r.choice([0, 4, 12, 20]))]
                h = cache.prefetch(tokens)
                res = h.load(r.choice(["best_effort", "wait_complete", "timeout"]), timeout=0.01)
                check_prefix(cache, ns4, tokens, res)  # whatever is served is byte-exact
                full = len(tokens) // 4
                if full > res.num_pages:
                    cache.insert(tokens, kv_for(ns4, tokens, first_page=res.num_pages), first_page=res.num_pages)
                h.release()
                with lock:
                    served[0] += 1
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a serving thread hung"
    assert not errors, errors[0]
    assert served[0] == 240
    assert cache.flush(timeout=30)
    cache.close()  # stops the write-back cleaner, which may start new copies after any flush
    # bookkeeping is exact once the movers are idle: every used slot belongs to exactly one node
    for tier, pool in ((Tier.DEVICE, cache.device_pool), (Tier.HOST, cache.host_pool)):
        slots = [s for n in cache.tree.nodes() if n.slots(tier) is not None for s in n.slots(tier).tolist()]
        assert len(slots) == len(set(slots)) == pool.num_used == cache.tree.pages_in(tier)
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())
    stats = cache.stats()
    assert all(v == 0 for v in stats["queue_depths"].values()), stats["queue_depths"]
    assert not stats["failures"], stats["failures"]  # no fault was injected: no transfer may fail
    assert store.counters.io_errors == store.counters.corrupt == 0
    assert stats["evictions"]["device"] > 0 and stats["pages_moved"]["device_to_host"] + stats["pages_moved"]["host_to_storage"] > 0
    store.close()
