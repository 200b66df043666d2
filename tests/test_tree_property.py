"""The radix tree against a page-level reference model, under random operation sequences.

The model knows nothing about nodes or splits: it keeps, per page chain (the tuple of pages
from the sequence start), which memory tiers hold it, which chains exist structurally, and
lock counts. Node-level effects the tree chooses (which victim, node boundaries) are checked
for legality and then mirrored page by page.
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Set, Tuple

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixtier.hashing import KVNamespace, PageHasher
from radixtier.tiers import Tier
from radixtier.tree import RadixTree

PS = 2
Chain = Tuple[Tuple[int, ...], ...]
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=12)


def chains(tokens: List[int]) -> List[Chain]:
    pages = [tuple(tokens[i:i + PS]) for i in range(0, len(tokens) - len(tokens) % PS, PS)]
    return [tuple(pages[:i + 1]) for i in range(len(pages))]


class TreeVsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(PageHasher(KVNamespace("m", "int32", "flat", PS)))
        self.slot = itertools.count()
        self.presence: Dict[Chain, Set[Tier]] = {}
        self.structure: Set[Chain] = set()
        self.locks: Dict[Chain, int] = {}
        self.handles: List[Tuple[object, List[Chain]]] = []

    # -- model helpers ---------------------------------------------------------------
    def node_chains(self, node) -> List[Chain]:
        path = self.tree.path_to_root(node)
        tokens = [int(t) for n in path for t in n.tokens]
        return chains(tokens)[-node.num_pages:]

    def model_prune(self, chain: Chain) -> None:
        while chain:
            has_child = any(len(c) == len(chain) + 1 and c[:-1] == chain for c in self.structure)
            if self.presence.get(chain) or has_child or self.locks.get(chain, 0) or chain not in self.structure:
                return
            self.structure.discard(chain)
            self.presence.pop(chain, None)
            chain = chain[:-1]

    # -- rules -----------------------------------------------------------------------
    @rule(tokens=seqs)
    def insert(self, tokens):
        expected_match = 0
        for c in chains(tokens):
            if c not in self.structure:
                break
            expected_match += 1
        m, node = self.tree.insert(tokens)
        assert m.num_pages == expected_match
        all_chains = chains(tokens)
        if node is None:
            assert expected_match == len(all_chains)
            return
        assert node.num_pages == len(all_chains) - expected_match
        self.tree.set_slots(node, Tier.DEVICE, [next(self.slot) for _ in range(node.num_pages)])
        for c in all_chains[expected_match:]:
            self.structure.add(c)
            self.presence[c] = {Tier.DEVICE}

    @rule(tokens=seqs)
    def match(self, tokens):
        m = self.tree.match(tokens)
        up = self.tree.usable_prefix(m)
        want_d = want_h = 0
        for c in chains(tokens):
            tiers = self.presence.get(c) if c in self.structure else None
            if not tiers:
                break
            if Tier.DEVICE in tiers:
                want_d += 1
            else:
                want_h += 1
        assert up.pages_in(Tier.DEVICE) == want_d
        assert up.pages_in(Tier.HOST) == want_h
        assert up.num_pages == want_d + want_h
        self.tree.touch(up.nodes)

    @rule(tier=st.sampled_from([Tier.DEVICE, Tier.HOST]))
    def evict_one(self, tier):
        victim = self.tree.peek_victim(tier)
        legal = []
        for c, tiers in self.presence.items():
            if tier in tiers and not self.locks.get(c, 0):
                child_in_tier = any(len(d) == len(c) + 1 and d[:-1] == c and tier in self.presence.get(d, ())
                                    for d in self.presence)
                if not child_in_tier:
                    legal.append(c)
        if victim is None:
            assert not legal, f"tree found no {tier.label} victim but the model has {legal}"
            return
        vchains = self.node_chains(victim)
        assert vchains[-1] in legal, "victim is locked, or a child of it is still in this tier"
        assert victim.lock_ref == 0
        for c in vchains:
            assert tier in self.presence[c] and not self.locks.get(c, 0)
        self.tree.clear_slots(victim, tier)
        for c in vchains:
            self.presence[c].discard(tier)
        self.tree.prune(victim)
        self.model_prune(vchains[-1])

    @rule(data=st.data())
    def copy_to_host(self, data):
        cands = [n for n in self.tree.nodes() if n.device is not None and n.host is None]
        if not cands:
            return
        node = data.draw(st.sampled_from(sorted(cands, key=lambda n: n.id)))
        self.tree.set_slots(node, Tier.HOST, [next(self.slot) for _ in range(node.num_pages)])
        for c in self.node_chains(node):
            self.presence[c].add(Tier.HOST)

    @rule(tokens=seqs)
    def lock(self, tokens):
        m = self.tree.match(tokens)
        up = self.tree.usable_prefix(m)
        if not up.nodes:
            return
        last = up.nodes[-1]
        self.tree.lock(last)
        locked = chains(tokens)[:up.num_pages]
        for c in locked:
            self.locks[c] = self.locks.get(c, 0) + 1
        self.handles.append((last, locked))

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.handles) - 1))
        node, locked = self.handles.pop(i)
        self.tree.unlock(node)
        for c in locked:
            self.locks[c] -= 1
        self.tree.prune(node)
        self.model_prune(locked[-1])

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def counts_agree(self):
        for tier in (Tier.DEVICE, Tier.HOST):
            model = sum(1 for c in self.structure if tier in self.presence.get(c, ()))
            assert self.tree.pages_in(tier) == model
        assert sum(n.num_pages for n in self.tree.nodes()) == len(self.structure)

    @invariant()
    def locked_pages_keep_their_tiers(self):
        for c, n in self.locks.items():
            if n:
                assert self.presence.get(c), f"locked chain {c} lost every tier"


TestTreeVsModel = TreeVsModel.TestCase
TestTreeVsModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
