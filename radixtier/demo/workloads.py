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


def _session(name: str, ctx: List[int], turns: int, before: int, after: int, rng: random.Random,
             vocab: int) -> Session:
    """A session's requests: each turn adds `before` tokens, is sent, then adds `after` (the reply)."""
    reqs: Session = []
    for t in range(turns):
        ctx = ctx + _ids(rng, before, vocab)
        reqs.append(Request(name, t, list(ctx)))
        ctx = ctx + _ids(rng, after, vocab)
    return reqs


def multi_turn_chat(sessions: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
                    seed: int = 0, vocab: int = 32000) -> List[Session]:
    """Each session: system prompt, then turns of user message + (synthetic) assistant reply."""
    rng = random.Random(seed)
    system = _ids(rng, system_tokens, vocab)  # one chat service, one system prompt
    return [_session(f"chat-{s}", system, turns, user_tokens, reply_tokens, rng, vocab) for s in range(sessions)]


def agent_fleet(agents: int, steps: int, system_tokens: int, task_tokens: int, observation_tokens: int,
                seed: int = 1, vocab: int = 32000) -> List[Session]:
    """Agents share a long system prompt (tools, policies); each has its own task and observations."""
    rng = random.Random(seed)
    system = _ids(rng, system_tokens, vocab)
    return [_session(f"agent-{a}", system + _ids(rng, task_tokens, vocab), steps, 0, observation_tokens, rng, vocab)
            for a in range(agents)]



def document_chat(sessions: int, turns: int, system_tokens: int, document_tokens: int, user_tokens: int,
                  reply_tokens: int, seed: int = 2, vocab: int = 32000) -> List[Session]:
    """Long-context chat: a shared system prompt, then each user's own long document, then turns.

    Unlike `multi_turn_chat`, most of each prompt is private to its session, so the KV working
    set grows with the number of sessions and is what spills past HBM and DRAM.
    """
    rng = random.Random(seed)
    system = _ids(rng, system_tokens, vocab)
    return [_session(f"doc-{s}", system + _ids(rng, document_tokens, vocab), turns, user_tokens, reply_tokens, rng,
                     vocab) for s in range(sessions)]


def agent_types(types: int, agents_per_type: int, steps: int, system_tokens: int, task_tokens: int,
                observation_tokens: int, seed: int = 3, vocab: int = 32000) -> List[Session]:
    """Several agent types, each with its own long system prompt, shared by that type's agents.

    Sessions are ordered so types alternate (agent 0 of every type, then agent 1, ...): with
    more types than the upper tiers hold, shared prompts must come back from tier 3.
    """
    rng = random.Random(seed)
    prompts = [_ids(rng, system_tokens, vocab) for _ in range(types)]
    return [_session(f"agent-{k}-{j}", prompts[k] + _ids(rng, task_tokens, vocab), steps, 0, observation_tokens, rng,
                     vocab) for j in range(agents_per_type) for k in range(types)]
