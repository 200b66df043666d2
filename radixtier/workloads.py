"""Synthetic serving workloads: multi-turn chat sessions and agents sharing a long system prompt.

Token ids are random but deterministic (seeded). Each session is a list of requests that a
client sends in order, so a turn's prompt extends the previous turn's prompt and reply, as
in a real chat service; agents share one system prompt, as in an agent fleet.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List


@dataclass
class Request:
    session: str
    turn: int
    tokens: List[int]


Session = List[Request]


def _ids(rng: random.Random, n: int, vocab: int) -> List[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def multi_turn_chat(sessions: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
                    seed: int = 0, vocab: int = 32000) -> List[Session]:
    """Each session: system prompt, then turns of user message + (synthetic) assistant reply."""
    rng = random.Random(seed)
    system = _ids(rng, system_tokens, vocab)  # one chat service, one system prompt
    out: List[Session] = []
    for s in range(sessions):
        history = list(system)
        reqs: Session = []
        for t in range(turns):
            history += _ids(rng, user_tokens, vocab)
            reqs.append(Request(f"chat-{s}", t, list(history)))
            history += _ids(rng, reply_tokens, vocab)
        out.append(reqs)
    return out


def agent_fleet(agents: int, steps: int, system_tokens: int, task_tokens: int, observation_tokens: int,
                seed: int = 1, vocab: int = 32000) -> List[Session]:
    """Agents share a long system prompt (tools, policies); each has its own task and observations."""
    rng = random.Random(seed)
    system = _ids(rng, system_tokens, vocab)
    out: List[Session] = []
    for a in range(agents):
        ctx = system + _ids(rng, task_tokens, vocab)
        reqs: Session = []
        for step in range(steps):
            reqs.append(Request(f"agent-{a}", step, list(ctx)))
            ctx += _ids(rng, observation_tokens, vocab)
        out.append(reqs)
    return out

