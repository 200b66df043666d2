"""What a KV-aware router gains when it sees tier 3: an agent fleet replayed over two simulated
fleets of SGLang nodes, each routed by Dynamo's standalone KV indexer fed the nodes' KV events.

The two fleets are identical -- same nodes, same tiers, same requests in the same order -- except
for what their events say:
  tier 3 seen   each node publishes through radixtier's publisher: SGLang's device events plus
                radixtier's tier-3 events (BlockStored/BlockRemoved, medium DISK, tokens learned
                from the device events: radixtier/integrations/sglang/events/kv_events.py, the code the plugin runs)
  device only   each node publishes SGLang's device events alone, through SGLang's own publisher
                (what a router sees today: SGLang 0.5.23 emits nothing for tier 3)
Both fleets hold their pages in tier 3 all the same; only the router's knowledge differs.

The router (one `python -m dynamo.indexer` per run, both fleets registered as separate workers)
sends each request to the node of its fleet with the longest prefix Dynamo reports (any tier it
was told of), ties and misses to the node that served fewest requests. The node then serves the
prompt's leading pages from device/host, then tier 3, and computes the rest.

Simulated: each node's tiers, at page granularity -- device+host (one LRU of --fast-pages pages)
and tier 3 (LRU of --tier3-pages pages, written through), leaves evicted before their parents as in
SGLang's tree. Real: SGLang's event classes and ZMQ publisher, radixtier's tier-3 events, Dynamo's
indexer and match. Each request's events are applied before the next is routed (a sentinel block
through the same stream), so the replay is deterministic.

Reported per fleet: requests sent to a node holding part of their prompt, prompt tokens served from
device/host, from tier 3, and recomputed; and, for the tier-3 fleet, how many requests had a holder
Dynamo knew of in device/host vs in any tier at routing time. JSON, Markdown and PNG.

    python bench/router_gain.py [--nodes 4] [--agent-types 32] [--agents-per-type 2] [--steps 4] \\
        [--out bench/results/router_gain.json]      # about a minute; most of it the indexer's sync

With fewer system prompts than the fleet's device+host tiers hold, every prompt's system part stays
warm on some node, the device-only router finds it there, and the two fleets route alike: tier 3
helps the router once prefixes leave device and host (many agent types, long histories).

**Restart phase** (`--restart-at 0.5`, 0 to skip): two more fleets, both with tier-3 events, in
which node 0 restarts after that share of the requests -- its device and host come back empty, its
tier 3 intact, and the router forgets it (Dynamo is told AllBlocksCleared, as for a worker it lost).
They differ only in what the restarted node says: "re-announced" announces what its tier 3 holds
(radixtier's Tier3Events with `holdings`, the code the backend runs at open), "not re-announced"
does not (radixtier before it). Reported: requests after the restart, how many went to node 0,
prompt tokens it served from tier 3, and prompt tokens recomputed after the restart.
"""

from __future__ import annotations

import atexit
import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

PAGE = 64  # tokens a page (SGLang's --page-size in the demo and tests)


@dataclass(frozen=True)
class Page:
    key: str            # SGLang's page hash string (what the storage backend receives)
    block: int          # SGLang's event block hash of it
    tokens: Tuple[int, ...]


def chain(tokens: Sequence[int]) -> List[Page]:
    """The prompt's whole pages, hashed as SGLang chains them (each commits to every token before)."""
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    pages, prev = [], ""
    for i in range(len(tokens) // PAGE):
        part = tuple(tokens[i * PAGE:(i + 1) * PAGE])
        prev = hashlib.sha256((prev + "|" + ",".join(map(str, part))).encode()).hexdigest()
        pages.append(Page(prev, hash_str_to_int64(prev), part))
    return pages


def agent_fleet(agent_types: int, agents_per_type: int, steps: int, system_pages: int, step_pages: int,
                seed: int) -> List[List[int]]:
    """Prompts in arrival order: agents of a type share a system prompt; each agent's prompt grows by
    its last step's task and observation; agents take turns in a shuffled order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(system_pages * PAGE)] for _ in range(agent_types)]
    history = {(t, a): list(systems[t]) for t in range(agent_types) for a in range(agents_per_type)}
    queue = [agent for agent in history for _ in range(steps)]
    rng.shuffle(queue)
    prompts = []
    for agent in queue:
        history[agent] += [rng.randrange(1000, 30000) for _ in range(step_pages * PAGE)]
        prompts.append(list(history[agent]))
    return prompts


class LruPages:
    """One tier of a node: page keys, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: "OrderedDict[str, Page]" = OrderedDict()

    def touch(self, pages: Sequence[Page]) -> Tuple[List[Page], List[Page]]:
        """Use `pages` (a prompt's chain): returns (new pages in chain order, pages evicted). Touched
        leaf first, so the chain's root is the most recent and leaves go before their parents."""
        new = [p for p in pages if p.key not in self.pages]
        for p in reversed(pages):
            self.pages[p.key] = p
            self.pages.move_to_end(p.key)
        evicted = []
        while len(self.pages) > self.capacity:
            evicted.append(self.pages.popitem(last=False)[1])
        return new, evicted


@dataclass
class Served:
    fast: int = 0
    tier3: int = 0
    computed: int = 0
    requests: int = 0
    to_holder: int = 0          # sent to a node holding part of the prompt (in any of its tiers)
    known_fast: int = 0         # a node Dynamo knew to hold part of it in device/host
    known_any: int = 0          # ... in any tier Dynamo was told of
    per_node: Dict[int, int] = field(default_factory=dict)
    after_restart: Dict[str, int] = field(default_factory=dict)


class SimNode:
    """One SGLang node: its tiers, and its KV-event stream (with or without tier 3)."""

    def __init__(self, worker_id: int, endpoint: str, fast_pages: int, tier3_pages: int, tier3_events: bool) -> None:
        from sglang.srt.disaggregation.kv_events import ZmqEventPublisher

        from radixtier.integrations.sglang.events.stream import RadixtierEventPublisher
        from radixtier.integrations.sglang.events.kv_events import Tier3Events

        self.worker_id = worker_id
        self.fast, self.tier3 = LruPages(fast_pages), LruPages(tier3_pages)
        self.parent_of: Dict[str, Optional[int]] = {}  # page key -> its parent's block hash
        if tier3_events:
            self.stream = RadixtierEventPublisher(0, endpoint=endpoint)
            self.events: Optional[Tier3Events] = Tier3Events.joined_to(self.stream, PAGE)
        else:
            self.stream = ZmqEventPublisher(0, endpoint=endpoint)
            self.events = None
        self._sentinel: Optional[int] = None

    def serve(self, pages: List[Page]) -> Tuple[int, int]:
        """Serve a prompt: (pages from device/host, pages from tier 3), then hold all of it."""
        from sglang.srt.disaggregation.kv_events import BlockRemoved, KVEventBatch

        fast = tier3 = 0
        for p in pages:
            if p.key in self.fast.pages:
                fast += 1
            elif p.key in self.tier3.pages:
                tier3 += 1
            else:
                break
        new, evicted = self.fast.touch(pages)
        events: List[object] = [BlockRemoved(block_hashes=[p.block for p in evicted], medium="GPU")] if evicted else []
        events += stored_runs(pages, {p.key for p in new}, "GPU")
        if events:
            self.stream.publish(KVEventBatch(ts=time.time(), events=events))
        for i, p in enumerate(pages):
            self.parent_of.setdefault(p.key, pages[i - 1].block if i else None)
        new3, evicted3 = self.tier3.touch(pages)  # written through
        if self.events is not None:
            if evicted3:
                self.events.removed([p.key.encode() for p in evicted3])
            fresh = {p.key for p in new3}
            for run, parent in runs(pages, fresh):
                self.events.stored([p.key for p in run], parent, [p.key.encode() for p in run], [True] * len(run))
        return fast, tier3

    def sync(self, indexer, seq: int) -> None:
        """Return once Dynamo applied everything this node published (a sentinel block after it)."""
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch

        if self.events is not None and not self.events.flush(30):
            raise RuntimeError("tier-3 events did not drain in 30 s")
        tokens = [1 + (seq * 7 + i) % 997 for i in range(PAGE)]  # ids below any prompt's
        block = -(seq + 1)
        events: List[object] = [BlockStored(block_hashes=[block], parent_block_hash=None, token_ids=tokens,
                                            block_size=PAGE, lora_id=None, medium="GPU")]
        if self._sentinel is not None:
            events.insert(0, BlockRemoved(block_hashes=[self._sentinel], medium="GPU"))
        self._sentinel = block
        deadline = time.monotonic() + 30
        while True:  # published again until seen: the first batches may precede the SUB's join
            self.stream.publish(KVEventBatch(ts=time.time(), events=events))
            answer = indexer.wait_for(tokens, lambda a: a.get(self.worker_id, {}).get("gpu", 0) == PAGE, 2.0)
            if answer.get(self.worker_id, {}).get("gpu", 0) == PAGE:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Dynamo's indexer never applied worker {self.worker_id}'s events")
            events = [e for e in events if isinstance(e, BlockStored)]

    def restart(self, reannounce: bool) -> None:
        """The node restarts: device and host come back empty, tier 3 intact; the router forgets it
        (AllBlocksCleared); then its tier-3 events start again, announcing what tier 3 holds or not."""
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared, KVEventBatch

        from radixtier.integrations.sglang.events.kv_events import Tier3Events, parents_first

        self.fast = LruPages(self.fast.capacity)
        if self.events is not None:
            self.events.close()
        self.stream.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        held = {p.block: p for p in self.tier3.pages.values()}
        order = parents_first([(p.block, self.parent_of.get(p.key)) for p in self.tier3.pages.values()])

        def holdings():
            pages = [(held[h].key.encode(), h, parent, list(held[h].tokens)) for h, parent in order]
            for i in range(0, len(pages), 256):
                yield pages[i:i + 256]
        self.events = Tier3Events.joined_to(self.stream, PAGE, holdings=holdings if reannounce else None,
                                            announce_after_s=0.0)

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.stream.shutdown()
        atexit.unregister(self.stream.shutdown)  # SGLang's publisher registers it; a second call waits 1 s


def runs(pages: List[Page], fresh: set) -> List[Tuple[List[Page], Optional[str]]]:
    """Maximal runs of consecutive fresh pages, each with the key of the page before it."""
    out: List[Tuple[List[Page], Optional[str]]] = []
    for i, p in enumerate(pages):
        if p.key not in fresh:
            continue
        if out and out[-1][0][-1] is pages[i - 1]:
            out[-1][0].append(p)
        else:
            out.append(([p], pages[i - 1].key if i else None))
    return out


def stored_runs(pages: List[Page], fresh: set, medium: str) -> List[object]:
    """SGLang's BlockStored events for the fresh pages of a prompt, one per run, with tokens."""
    from sglang.srt.disaggregation.kv_events import BlockStored
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    return [BlockStored(block_hashes=[p.block for p in run], parent_block_hash=None if parent is None
                        else hash_str_to_int64(parent), token_ids=[t for p in run for t in p.tokens],
                        block_size=PAGE, lora_id=None, medium=medium) for run, parent in runs(pages, fresh)]


def replay(prompts: List[List[int]], nodes: List[SimNode], indexer, progress, restart_at: Optional[int] = None,
           reannounce: bool = False) -> Served:
    out = Served(per_node={n.worker_id: 0 for n in nodes})
    ids = [n.worker_id for n in nodes]
    after = {"requests": 0, "to_restarted": 0, "restarted_tier3_tokens": 0, "tokens_computed": 0}
    for seq, tokens in enumerate(prompts):
        if seq == restart_at:
            nodes[0].restart(reannounce)
            nodes[0].sync(indexer, -1 - seq)
        pages = chain(tokens)
        answer = indexer.query([t for p in pages for t in p.tokens])
        held = {w: answer.get(w, {}).get("longest_matched", 0) for w in ids}
        out.known_fast += any(answer.get(w, {}).get("cpu", 0) > 0 for w in ids)
        out.known_any += any(v > 0 for v in held.values())
        best = max(held.values())
        choice = min((w for w in ids if held[w] == best), key=lambda w: (out.per_node[w], w))
        node = nodes[ids.index(choice)]
        holders = [n for n in nodes if pages and (pages[0].key in n.fast.pages or pages[0].key in n.tier3.pages)]
        out.to_holder += node in holders
        fast, tier3 = node.serve(pages)
        node.sync(indexer, seq)
        out.fast += fast * PAGE
        out.tier3 += tier3 * PAGE
        out.computed += len(tokens) - (fast + tier3) * PAGE
        out.requests += 1
        out.per_node[choice] += 1
        if restart_at is not None and seq >= restart_at:
            after["requests"] += 1
            after["to_restarted"] += node is nodes[0]
            after["restarted_tier3_tokens"] += tier3 * PAGE if node is nodes[0] else 0
            after["tokens_computed"] += len(tokens) - (fast + tier3) * PAGE
        progress.update(1)
    out.after_restart = after if restart_at is not None else {}
    return out


def run(args) -> Dict[str, object]:
    from tqdm import tqdm

    import zmq

    from radixtier.testing.dynamo_indexer import DynamoIndexer
    from radixtier.testing.redis_server import free_port

    prompts = agent_fleet(args.agent_types, args.agents_per_type, args.steps, args.system_pages, args.step_pages,
                          args.seed)
    fleets = {"tier 3 seen": True, "device only": False}
    restart_at = int(len(prompts) * args.restart_at) if args.restart_at > 0 else None
    if restart_at is not None:
        fleets.update({"restart, re-announced": True, "restart, not re-announced": True})
    keys = [(f, i) for f in fleets for i in range(args.nodes)]
    chosen: List[int] = []
    while len(chosen) < len(keys):  # distinct: two draws of free_port may name one port
        port = free_port()
        if port not in chosen:
            chosen.append(port)
    ports = dict(zip(keys, chosen))
    wid = {(f, i): (k + 1) * 100 + i for k, f in enumerate(fleets) for i in range(args.nodes)}
    results: Dict[str, object] = {}
    with tempfile.TemporaryDirectory() as work:
        nodes: Dict[str, List[SimNode]] = {f: [] for f in fleets}
        indexer = None
        try:  # every node made is closed, also when a later one fails (its stream would stay bound)
            for f, seen in fleets.items():
                for i in range(args.nodes):
                    for attempt in range(5):  # a port free on loopback may be taken on another interface
                        try:
                            nodes[f].append(SimNode(wid[(f, i)], f"tcp://*:{ports[(f, i)]}", args.fast_pages,
                                                    args.tier3_pages, seen))
                            break
                        except zmq.ZMQError:
                            if attempt == 4:
                                raise
                            ports[(f, i)] = next(p for p in iter(free_port, None) if p not in ports.values())
            indexer = DynamoIndexer(work, PAGE, {wid[k]: f"tcp://127.0.0.1:{p}" for k, p in ports.items()})
            with tqdm(total=len(prompts) * len(fleets), desc="router replay", unit="req") as progress:
                for fleet in fleets:
                    restarts = fleet.startswith("restart")
                    served = replay(prompts, nodes[fleet], indexer, progress, restart_at if restarts else None,
                                    reannounce=fleet == "restart, re-announced")
                    total = served.fast + served.tier3 + served.computed
                    results[fleet] = {
                        "requests": served.requests, "to_prefix_holder": served.to_holder,
                        "known_holder_device_host": served.known_fast, "known_holder_any_tier": served.known_any,
                        "tokens_device_host": served.fast, "tokens_tier3": served.tier3,
                        "tokens_computed": served.computed, "prompt_tokens": total,
                        "reuse_share": (served.fast + served.tier3) / total if total else 0.0,
                        "requests_per_node": served.per_node, "after_restart": served.after_restart}
        finally:
            if indexer is not None:
                indexer.stop()
            for fleet_nodes in nodes.values():
                for n in fleet_nodes:
                    n.close()
    seen, blind = results["tier 3 seen"], results["device only"]
    report = {"config": vars(args), "prompts": len(prompts), "fleets": results,
              "computed_ratio": blind["tokens_computed"] / max(1, seen["tokens_computed"])}
    if restart_at is not None:
        report["restart_at"] = restart_at
        report["restart_computed_ratio"] = (results["restart, not re-announced"]["after_restart"]["tokens_computed"]
                                            / max(1, results["restart, re-announced"]["after_restart"]["tokens_computed"]))
    return report


def markdown(report: Dict[str, object]) -> str:
    cfg = report["config"]
    lines = [f"Agent fleet: {cfg['agent_types']} system prompts of {cfg['system_pages'] * PAGE} tokens, "
             f"{cfg['agents_per_type']} agents each, {cfg['steps']} steps of +{cfg['step_pages'] * PAGE} tokens "
             f"({report['prompts']} requests); {cfg['nodes']} nodes, device+host {cfg['fast_pages'] * PAGE} tokens "
             f"and tier 3 {cfg['tier3_pages'] * PAGE} tokens each; routed by Dynamo's indexer (ai-dynamo-runtime).",
             "",
             "| router sees | sent to a node holding part of the prompt | a holder known in device/host | "
             "in any tier | prompt tokens from device/host | from tier 3 | recomputed | reuse |",
             "|---|---|---|---|---|---|---|---|"]
    for fleet, r in report["fleets"].items():
        if fleet.startswith("restart"):
            continue
        n = r["requests"]
        lines.append(f"| {fleet} | {r['to_prefix_holder']}/{n} | {r['known_holder_device_host']}/{n} | "
                     f"{r['known_holder_any_tier']}/{n} | {r['tokens_device_host']:,} | {r['tokens_tier3']:,} | "
                     f"{r['tokens_computed']:,} | {r['reuse_share']:.0%} |")
    lines += ["", f"Prefill tokens recomputed, device-only router / tier-3-aware router: "
                  f"{report['computed_ratio']:.2f}x"]
    if "restart_at" in report:
        lines += ["", f"Node 0 restarts after request {report['restart_at']} (device and host empty, tier 3 kept; "
                      f"the router forgets it); both fleets publish tier-3 events:", "",
                  "| restarted node | requests after the restart | sent to it | its prompt tokens from tier 3 | "
                  "prompt tokens recomputed after the restart |", "|---|---|---|---|---|"]
        for fleet in ("restart, re-announced", "restart, not re-announced"):
            a = report["fleets"][fleet]["after_restart"]
            lines.append(f"| {fleet.split(', ', 1)[1]} | {a['requests']} | {a['to_restarted']} | "
                         f"{a['restarted_tier3_tokens']:,} | {a['tokens_computed']:,} |")
        lines += ["", f"Prefill tokens recomputed after the restart, not re-announced / re-announced: "
                      f"{report['restart_computed_ratio']:.2f}x"]
    return "\n".join(lines) + "\n"


def plot(report: Dict[str, object], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = list(report["fleets"])
    parts = [("tokens_device_host", "device/host", "#2e8b57"), ("tokens_tier3", "tier 3", "#4682b4"),
             ("tokens_computed", "recomputed", "#cd5c5c")]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    left = [0.0] * len(fleets)
    for key, label, colour in parts:
        vals = [report["fleets"][f][key] for f in fleets]
        ax.barh(fleets, vals, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("prompt tokens")
    ax.set_title("Agent fleet, routed by Dynamo's KV indexer: where prompt tokens came from")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4, help="nodes in each fleet (default 4)")
    ap.add_argument("--agent-types", type=int, default=32,
                    help="distinct system prompts (default 32: more than the fleet's device+host tiers hold)")
    ap.add_argument("--agents-per-type", type=int, default=2, help="agents sharing each system prompt (default 2)")
    ap.add_argument("--steps", type=int, default=4, help="requests per agent (default 4)")
    ap.add_argument("--system-pages", type=int, default=32, help="pages of a system prompt (default 32: 2,048 tokens)")
    ap.add_argument("--step-pages", type=int, default=4, help="pages each step adds (default 4: 256 tokens)")
    ap.add_argument("--fast-pages", type=int, default=192, help="device+host pages a node holds (default 192)")
    ap.add_argument("--tier3-pages", type=int, default=4096, help="tier-3 pages a node holds (default 4096)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--restart-at", type=float, default=0.5,
                    help="share of the requests after which node 0 restarts, in two more fleets (0: no restart phase)")
    ap.add_argument("--out", default="bench/results/router_gain.json", help="JSON; Markdown and PNG beside it")
    args = ap.parse_args(argv)
    for name in ("nodes", "agent_types", "agents_per_type", "steps", "system_pages", "step_pages", "fast_pages",
                 "tier3_pages"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive whole number, got {getattr(args, name)}")
    if not 0 <= args.restart_at < 1:  # also refuses nan
        ap.error(f"--restart-at: expected a share of the requests in [0, 1), got {args.restart_at}")
    report = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    md = markdown(report)
    stem = os.path.splitext(args.out)[0]
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(report, stem + ".png")
    print(md)
    print(f"wrote {args.out}, {stem}.md, {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
