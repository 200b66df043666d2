"""What the cache hands back to serving: match results, load results, and a request's prefix handle."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Tuple, Union

from radixtier.policies import PrefetchPolicy
from radixtier.tiers import Tier
from radixtier.tree import Node


@dataclass
class MatchResult:
    """Longest cached prefix of a request and which tier holds each part (tokens)."""

    prefix_tokens: int
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0
    remote_tokens: int = 0

    def by_tier(self) -> Dict[Tier, int]:
        return {Tier.DEVICE: self.device_tokens, Tier.HOST: self.host_tokens,
                Tier.STORAGE: self.storage_tokens, Tier.REMOTE: self.remote_tokens}


@dataclass
class LoadResult:
    """What a request can reuse right now: `num_pages` leading pages, resident at `device_slots`."""

    num_pages: int
    num_tokens: int
    device_slots: List[int]
    hits_by_tier: Dict[Tier, int] = field(default_factory=dict)  # tokens served per source tier


class PrefixLoader(Protocol):
    """What a handle needs from the code that made it (the planner): loading and releasing its
    prefix. A protocol, so this module does not import the planner back."""

    def load(self, handle: "PrefixHandle", policy: Union[str, PrefetchPolicy, None],
             timeout: Optional[float]) -> LoadResult: ...

    def release(self, handle: "PrefixHandle") -> None: ...


class PrefixHandle:
    """A request's claim on its cached prefix. Pages stay locked (never evicted) until release().

    Owned by the serving thread that made it; its fields are written only by the planner, under
    the cache lock."""

    def __init__(self, planner: PrefixLoader, num_tokens: int) -> None:
        self._planner = planner
        self.num_tokens = num_tokens
        self.locked: List[Node] = []
        self.stages: List[Future] = []  # storage/remote -> host promotions this prefix waits on
        self.plan: List[Tuple[int, Tier]] = []  # (pages, source tier) in prefix order
        self.last: Optional[Node] = None
        self.result: Optional[LoadResult] = None
        self._released = False

    @property
    def planned_pages(self) -> int:
        return sum(p for p, _ in self.plan)

    def load(self, policy: Union[str, PrefetchPolicy, None] = None, timeout: Optional[float] = None) -> LoadResult:
        """Bring the prefix onto the device; storage/remote stages are waited on per `policy`."""
        self.result = self._planner.load(self, policy, timeout)
        return self.result

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._planner.release(self)

    def __enter__(self) -> "PrefixHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
