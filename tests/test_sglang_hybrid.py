"""Hybrid models through SGLang's real server with radixtier as L3: the KV pool through the v1
calls and the sidecar pools (Mellum's sliding-window pool, LFM2's convolution state in the Mamba
pool) through HiCache's v2 calls, as users now run them. Greedy outputs are compared with the same server without L3 (tokens equal, logprobs
within 0.01), after a /flush_cache and after a restart on the same namespace.

Mellum (SGLang's `MellumForCausalLM`): a tiny random model whose 4 layers alternate sliding-window
(128 tokens) and full attention, dense MLPs. SGLang keeps the sliding layers' KV in an SWA pool and
HiCache backs it up page by page beside the KV pool (`batch_set_v2` / `batch_get_v2`, pool `swa`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator

import pytest
import requests

from radixtier.testing.skips import require_sglang

require_sglang("uvicorn")
require_sglang("sglang.srt.mem_cache.hicache_storage")

from radixtier.demo import http_load  # noqa: E402
from radixtier.demo.hf_model import HFModelSpec, write_model  # noqa: E402
from radixtier.integrations.sglang.launch.cpu_support import cuda_present  # noqa: E402
from radixtier.integrations.sglang.launch.server import (SGLangServer, hicache_args, radixtier_args,  # noqa: E402
                                                         start_together)
from radixtier.native_dtype import resolve_dtype  # noqa: E402
from radixtier.storage.nvmeof.inspect import inspect_namespace  # noqa: E402
from radixtier.testing.server_checks import (explained, passes, same_outputs, storage_tokens,  # noqa: E402
                                             wait_for_backups)

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_server]

DEVICE = "cuda" if cuda_present() else "cpu"
KV_SCALE = 2 if DEVICE == "cpu" and resolve_dtype("auto")[0] == "float32" else 1
MELLUM = HFModelSpec(family="mellum", sliding_window=128)
# a device pool of 4,096 tokens; SGLang sizes the SWA pool from it
ARGS = ["--page-size", "64", "--max-total-tokens", "4096", "--max-running-requests", "4", "--enable-cache-report",
        "--enable-metrics", "--log-level", "info"]
# prompts well past the 128-token window: a load must bring each sliding layer's last window back
CHAT = http_load.multi_turn_chat(sessions=2, turns=3, system_chars=900, user_chars=150, reply_chars=80, seed=41)
FRESH = http_load.multi_turn_chat(sessions=3, turns=2, system_chars=800, user_chars=150, reply_chars=80, seed=47)


@contextlib.contextmanager
def reference_and_radixtier(model: str, args: list, work, record: Callable[[SGLangServer], dict]) -> Iterator[tuple]:
    """The same server without L3 and with radixtier, started together (a start-up is mostly imports);
    `record(reference)` runs while radixtier's server waits paused, then the reference stops.
    Yields (what record returned, the radixtier server, its namespace)."""
    ref = SGLangServer(model, args + hicache_args(extra_config=None, backend="", device=DEVICE),
                       log_path=str(work / "reference.log"), device=DEVICE)
    ns = str(work / "ns.img")
    rt = SGLangServer(model, args + radixtier_args(ns, capacity=f"{128 * KV_SCALE}MiB", device=DEVICE),
                      log_path=str(work / "radixtier.log"), device=DEVICE)
    start_together([ref, rt])
    try:
        rt.pause()
        with explained(ref):
            out = record(ref)
        ref.stop()
        rt.resume()
        yield out, rt, ns
    finally:
        ref.stop()
        rt.stop()


@pytest.fixture(scope="class")
def mellum(tmp_path_factory):
    model = write_model(str(tmp_path_factory.getbasetemp() / "toy-mellum"), MELLUM)
    def record(ref: SGLangServer) -> dict:
        return {**passes(ref, CHAT), "fresh": http_load.replay(ref.url, FRESH)}
    with reference_and_radixtier(model, ARGS, tmp_path_factory.mktemp("mellum"), record) as out:
        yield out


def corrupt_every_other_page(ns: str) -> int:
    """Flip one payload byte in every other used slot of the namespace (KV and SWA pages alike, as
    they interleave): a sidecar page corrupt while its KV page is sound, and the reverse."""
    from radixtier.storage.nvmeof.layout import ENTRY_BYTES, HEADER_BYTES, TableEntry
    from radixtier.storage.nvmeof.namespace import read_superblock

    sb = read_superblock(ns)
    with open(ns, "r+b") as f:
        f.seek(sb.table_offset)
        table = f.read(sb.slot_count * ENTRY_BYTES)
        used = [i for i in range(sb.slot_count) if TableEntry.unpack(table[i * ENTRY_BYTES:(i + 1) * ENTRY_BYTES])]
        for slot in used[::2]:
            offset = sb.slot_offset(slot) + HEADER_BYTES + 100
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
    return len(used[::2])


class TestMellum:
    """Cases sharing one Mellum pair (stopped after the last: an idle scheduler spins a core)."""

    def test_mellum_chat_after_flush_and_restart_loads_kv_and_swa_pages_with_the_same_outputs(self, mellum):
        """Mellum through SGLang's real server: after /flush_cache and after a restart on the same
        namespace, prompts come partly from tier 3 (KV pages through the v1 calls, the sliding-window
        sidecar through v2) and every greedy answer equals the server without L3; every page verifies."""
        reference, s, ns = mellum
        with explained(s):
            runs = passes(s, CHAT)
            same_outputs(reference["cold"], runs["cold"])
            assert storage_tokens(runs["cold"]) == 0
            assert storage_tokens(runs["flushed"]) > 0, [r.cached for r in runs["flushed"].replies]
            same_outputs(reference["flushed"], runs["flushed"])
            s.stop()
            report = inspect_namespace(ns, verify=True)
            assert report["used"] > 0 and report["errors"] == [], report["errors"][:5]
            s.start()  # the same namespace: tier 3 (KV and SWA pages) survives the process
            again = http_load.replay(s.url, CHAT)
            assert storage_tokens(again) > 0, [r.cached for r in again.replies]
            same_outputs(reference["flushed"], again)

    def test_mellum_killed_while_backing_up_kv_and_swa_pages_restarts_verified_with_the_same_outputs(self, mellum):
        """kill -9 while KV and sliding-window pages of fresh conversations are being backed up (a KV
        page may land without its SWA page, or the reverse): the namespace verifies, and after the
        restart those conversations load what landed -- a shorter hit or a miss -- with the answers
        of the server without L3."""
        reference, s, ns = mellum
        with explained(s):
            seen = []

            def kill_after_two(reply) -> None:
                seen.append(reply)
                if len(seen) == 2:
                    s.kill()
            with pytest.raises((requests.RequestException, RuntimeError)):
                http_load.replay(s.url, FRESH, concurrency=3, on_reply=kill_after_two)
            report = inspect_namespace(ns, verify=True)
            assert report["errors"] == [], report["errors"][:5]
            s.start()
            same_outputs(reference["fresh"], http_load.replay(s.url, FRESH))

    def test_mellum_with_half_its_kv_and_swa_pages_corrupt_serves_the_same_outputs_and_keeps_prefetching(self, mellum):
        """(Last of the class: the pages it damages and nothing reads again stay damaged.) Every other tier-3 page damaged while the server is down (a sliding-window page bad beside a
        sound KV page, and the reverse): each load is a shorter hit or a miss (SGLang discards a hybrid
        prefetch whose SWA pages did not all come), the answers stay the reference's, and the prefetch
        path keeps working: once SGLang backed the pages up again, a flush later they load from tier 3."""
        reference, s, ns = mellum
        with explained(s):
            http_load.replay(s.url, CHAT)  # in tier 3, whichever case ran before
            wait_for_backups(s)
            s.stop()
            assert corrupt_every_other_page(ns) > 0
            s.start()
            damaged = http_load.replay(s.url, CHAT)
            same_outputs(reference["flushed"], damaged)
            s.flush_cache()
            again = http_load.replay(s.url, CHAT)  # SGLang still believed the freed pages stored: misses, then
            same_outputs(reference["flushed"], again)  # it drops that belief and backs the pages up again
            s.flush_cache()
            healed = http_load.replay(s.url, CHAT)
            assert storage_tokens(healed) > 0, [r.cached for r in healed.replies]
            same_outputs(reference["flushed"], healed)



# ---------------------------------------------------------------- LFM2: convolution state in SGLang's Mamba pool
LFM2 = HFModelSpec(family="lfm2")
# page size 1 (SGLang's Mamba `no_buffer` strategy takes no other); 32 state slots (default: millions)
LFM2_ARGS = ["--page-size", "1", "--max-mamba-cache-size", "32", "--max-total-tokens", "4096", "--max-running-requests",
             "4", "--enable-cache-report", "--enable-metrics", "--log-level", "info"]
LFM2_CHAT = http_load.multi_turn_chat(sessions=2, turns=2, system_chars=600, user_chars=100, reply_chars=50, seed=43)
# SGLang keeps a Mamba-type state only where a prompt ended: after a flush a conversation's next turn
# (whose prompt extends the last one) is what can come from tier 3, not the same prompt again
LFM2_NEXT = [http_load.Conversation(c.name, c.turns[1:], first_turn=1) for c in LFM2_CHAT]


def lfm2_passes(s: SGLangServer) -> Dict[str, http_load.Run]:
    first = http_load.replay(s.url, [http_load.Conversation(c.name, c.turns[:1]) for c in LFM2_CHAT])
    s.flush_cache()
    return {"first": first, "next": http_load.replay(s.url, LFM2_NEXT)}


@pytest.fixture(scope="class")
def lfm2(tmp_path_factory):
    model = write_model(str(tmp_path_factory.getbasetemp() / "toy-lfm2"), LFM2)
    with reference_and_radixtier(model, LFM2_ARGS, tmp_path_factory.mktemp("lfm2"), lfm2_passes) as out:
        yield out


class TestLfm2:
    """The LFM2 pair's case (its servers stop after it)."""

    def test_lfm2_next_turn_after_flush_and_restart_loads_kv_and_conv_state_with_the_same_outputs(self, lfm2):
        """LFM2 through SGLang's real server: after /flush_cache, and after a restart on the same
        namespace, a conversation's next turn loads its prefix from tier 3 -- KV pages through the v1
        calls, the convolution state (SGLang's Mamba pool) through v2 -- with the reference's answers."""
        reference, s, ns = lfm2
        with explained(s):
            runs = lfm2_passes(s)
            same_outputs(reference["first"], runs["first"])
            assert storage_tokens(runs["next"]) > 0, [r.cached for r in runs["next"].replies]
            same_outputs(reference["next"], runs["next"])
            s.stop()
            report = inspect_namespace(ns, verify=True)
            assert report["used"] > 0 and report["errors"] == [], report["errors"][:5]
            s.start()
            again = http_load.replay(s.url, LFM2_NEXT)
            assert storage_tokens(again) > 0, [r.cached for r in again.replies]
            same_outputs(reference["next"], again)

