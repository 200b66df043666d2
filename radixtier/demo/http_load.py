"""Multi-turn chat and agent-fleet traffic sent to a real SGLang server over its OpenAI API.

Every request streams (`/v1/chat/completions`, greedy), so the client measures time to first
token as a user sees it, and reads SGLang's own accounting from the last chunks: output token
ids, per-token logprobs, and `cached_tokens_details` (prompt tokens SGLang served from device,
host and storage, with `--enable-cache-report`).

Workloads are text, one token per ASCII character with the toy model's byte-level tokenizer,
seeded and identical for every server they are replayed against. Assistant turns in a
conversation are fixed text (as the embedded demo's synthetic replies), so a replay sends the
same prompts whatever the model answers; the model's answers are still generated and compared.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import requests

from radixtier.demo.stats import percentile

Messages = List[Dict[str, str]]
TIERS = ("device", "host", "storage")


@dataclass
class Reply:
    """One request as the client saw it, with SGLang's own figures for it."""

    conversation: str
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    output_ids: List[int]
    logprobs: List[float]
    cached: Dict[str, int] = field(default_factory=dict)  # tokens from device / host / storage
    margins: List[float] = field(default_factory=list)  # per token: best logprob - runner-up's


@dataclass
class Conversation:
    """A client's requests in order: each turn's messages extend the previous turn's."""

    name: str
    turns: List[Messages]
    first_turn: int = 0  # the number of turns[0] (a conversation continued from another server's turns)


def _words(rng: random.Random, chars: int) -> str:
    out: List[str] = []
    n = 0
    while n < chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def multi_turn_chat(sessions: int, turns: int, system_chars: int, user_chars: int, reply_chars: int,
                    seed: int = 11) -> List[Conversation]:
    """Chat sessions of one service (one system prompt); each turn adds a user message, and the
    next turn also carries a fixed assistant reply."""
    rng = random.Random(seed)
    system = _words(rng, system_chars)
    out = []
    for s in range(sessions):
        msgs: Messages = [{"role": "system", "content": system}]
        conv = Conversation(f"chat-{s}", [])
        for _t in range(turns):
            msgs = msgs + [{"role": "user", "content": _words(rng, user_chars)}]
            conv.turns.append(msgs)
            msgs = msgs + [{"role": "assistant", "content": _words(rng, reply_chars)}]
        out.append(conv)
    return out


def agent_fleet(agent_types: int, agents_per_type: int, steps: int, system_chars: int, task_chars: int,
                observation_chars: int, seed: int = 12) -> List[Conversation]:
    """Agents whose type shares a long system prompt (tools, policies); each agent has its own task
    and adds a tool observation per step."""
    rng = random.Random(seed)
    out = []
    for a in range(agent_types):
        system = _words(rng, system_chars)
        for i in range(agents_per_type):
            msgs: Messages = [{"role": "system", "content": system},
                              {"role": "user", "content": _words(rng, task_chars)}]
            conv = Conversation(f"agent-{a}.{i}", [msgs])
            for _s in range(1, steps):
                msgs = msgs + [{"role": "assistant", "content": _words(rng, 48)},
                               {"role": "user", "content": "observation: " + _words(rng, observation_chars)}]
                conv.turns.append(msgs)
            out.append(conv)
    return out


def prompt_tokens(messages: Messages) -> int:
    """Tokens of a prompt under the toy model's chat template and one-token-a-character tokenizer."""
    return sum(len(m["role"]) + len(m["content"]) + 4 for m in messages) + len("<s>assistant: ") - 2


def split_last_turn(conversations: Sequence[Conversation]) -> Tuple[List[Conversation], List[Conversation]]:
    """(history, next): every conversation without its last turn, and its last turn alone -- a user
    coming back to a conversation whose history SGLang's device and host tiers no longer hold."""
    history = [Conversation(c.name, c.turns[:-1], c.first_turn) for c in conversations if len(c.turns) > 1]
    last = [Conversation(c.name, c.turns[-1:], c.first_turn + len(c.turns) - 1) for c in conversations]
    return history, last


def chat(url: str, messages: Messages, *, max_tokens: int = 8, conversation: str = "", turn: int = 0,
         session: Optional[requests.Session] = None, timeout_s: float = 600.0) -> Reply:
    """One greedy streamed chat completion; raises RuntimeError naming the server's answer on failure."""
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "skip_special_tokens": False, "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
            "return_cached_tokens_details": True, "return_output_ids_in_sglext": True}
    http = session or requests
    t0 = time.perf_counter()
    ttft = None
    logprobs: List[float] = []
    margins: List[float] = []
    ids: List[int] = []
    cached: Dict[str, int] = {}
    prompt_tokens = 0
    with http.post(url + "/v1/chat/completions", json=body, stream=True, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                lp = (choice.get("logprobs") or {}).get("content") or []
                if lp and ttft is None:
                    ttft = time.perf_counter() - t0
                logprobs += [x["logprob"] for x in lp]
                for x in lp:
                    top = sorted((t["logprob"] for t in x.get("top_logprobs") or []), reverse=True)
                    margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            ext = chunk.get("sglext") or {}
            if ext.get("output_ids"):
                ids = list(ext["output_ids"][0])
            if ext.get("cached_tokens_details"):
                cached = {t: int(ext["cached_tokens_details"].get(t) or 0) for t in TIERS}
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    latency = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return Reply(conversation, turn, ttft, latency, prompt_tokens, ids, logprobs, cached, margins)


def replay(url: str, conversations: Sequence[Conversation], *, concurrency: int = 1, max_tokens: int = 8,
           on_reply: Optional[Callable[[Reply], None]] = None) -> "Run":
    """Send every conversation (its turns in order), `concurrency` conversations at a time."""
    local = threading.local()

    def one(conv: Conversation) -> List[Reply]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        out = []
        for t, msgs in enumerate(conv.turns, start=conv.first_turn):
            rep = chat(url, msgs, max_tokens=max_tokens, conversation=conv.name, turn=t, session=local.session)
            out.append(rep)
            if on_reply is not None:
                on_reply(rep)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = [r for conv in pool.map(one, conversations) for r in conv]
    return Run(replies, time.perf_counter() - t0)


@dataclass
class Run:
    """One replay: its replies and the wall time it took (throughput = replies / wall)."""

    replies: List[Reply]
    wall_s: float

    def by_key(self) -> Dict[tuple, Reply]:
        return {(r.conversation, r.turn): r for r in self.replies}

    def summary(self) -> Dict[str, float]:
        """TTFT p50/p99 (s), requests/s, and the share of prompt tokens each tier served."""
        ttfts = [r.ttft_s for r in self.replies]
        prompt = sum(r.prompt_tokens for r in self.replies) or 1
        out = {"requests": len(self.replies), "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
               "ttft_mean_s": statistics.fmean(ttfts), "throughput_rps": len(self.replies) / self.wall_s,
               "prompt_tokens": prompt}
        for t in TIERS:
            out[f"{t}_tokens"] = sum(r.cached.get(t, 0) for r in self.replies)
            out[f"{t}_share"] = out[f"{t}_tokens"] / prompt
        return out


def agreement(reference: Run, other: Run, logprob_tol: float, near_tie: float = 0.0) -> Dict[str, List[str]]:
    """How two runs of the same workload agree, request by request: "identical" (every output token
    equal, each logprob within logprob_tol), "ties" (the answers part at a token where either run's
    two best candidates were within near_tie of each other: a numerical tie, after which the
    answers continue from different tokens) and "differ" (anything else: a wrong answer); and
    "worst_logprob_diff": [the largest logprob difference over the tokens both runs share]."""
    ref = reference.by_key()
    out: Dict[str, List] = {"identical": [], "ties": [], "differ": [], "worst_logprob_diff": [0.0]}
    for key, rep in sorted(other.by_key().items()):
        want = ref.get(key)
        if want is None:
            out["differ"].append(f"{key}: not in the reference run")
            continue
        if len(rep.logprobs) != len(rep.output_ids) or len(want.logprobs) != len(want.output_ids):
            out["differ"].append(f"{key}: {len(rep.logprobs)} logprobs for {len(rep.output_ids)} tokens "
                                 f"(reference: {len(want.logprobs)} for {len(want.output_ids)})")
            continue
        split = next((i for i, (a, b) in enumerate(zip(rep.output_ids, want.output_ids)) if a != b), None)
        same = rep.output_ids[:split] if split is not None else rep.output_ids
        worst = max((abs(a - b) for a, b in zip(rep.logprobs[:len(same)], want.logprobs[:len(same)])), default=0.0)
        out["worst_logprob_diff"][0] = max(out["worst_logprob_diff"][0], worst)
        if worst > logprob_tol:
            out["differ"].append(f"{key}: logprobs differ by {worst:.4f} (> {logprob_tol})")
        elif split is None and len(rep.output_ids) == len(want.output_ids):
            out["identical"].append(str(key))
        elif split is not None and min(_margin(rep, split), _margin(want, split)) <= near_tie:
            out["ties"].append(f"{key}: token {split}: {rep.output_ids[split]} vs {want.output_ids[split]}, top two "
                               f"within {min(_margin(rep, split), _margin(want, split)):.4f}")
        else:
            out["differ"].append(f"{key}: tokens {rep.output_ids} != reference {want.output_ids}")
    return out


def _margin(reply: Reply, i: int) -> float:
    return reply.margins[i] if i < len(reply.margins) else float("inf")


def compare(reference: Run, other: Run, logprob_tol: float) -> List[str]:
    """Every request of `other` that is not identical to the reference's (see agreement), one line each."""
    a = agreement(reference, other, logprob_tol)
    return a["ties"] + a["differ"]
