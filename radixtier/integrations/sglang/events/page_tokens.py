"""Token ids of the pages SGLang announced, learned from its own `BlockStored` events.

The storage backend receives page hashes, never tokens; a router matches a request to a worker by
hashing the request's tokens (Dynamo's indexer ignores a stored block that has none). SGLang's own
GPU/CPU events carry, for the same block hash, the page's tokens: this book keeps them for the
newest `capacity` pages (in one process SGLang's block hash of a page is the one tier 3 names it by,
when no extra_key or cache_salt namespaces the request), so tier-3 events can carry them honestly.

Memory: one bytes object (4 bytes a token) and one dict entry per page; 65,536 pages of 64 tokens
are about 25 MiB. Owned by one thread (the tier-3 events thread); not thread-safe.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Iterable, List, Optional

from sglang.srt.disaggregation.kv_events import BlockStored

TOKEN_PAGES = 1 << 16
_TOKEN_TYPE = "l"  # array type code wide enough for any vocabulary id


class PageTokens:
    """block hash -> the page's token ids, newest `capacity` pages (see the module docstring)."""

    def __init__(self, capacity: int = TOKEN_PAGES) -> None:
        self.capacity = capacity
        self._tokens: "OrderedDict[int, bytes]" = OrderedDict()
        self.learned = 0

    def learn(self, events: Iterable[object]) -> List[int]:
        """Read one SGLang batch's BlockStored events; returns the hashes newly learned."""
        new: List[int] = []
        for event in events:
            if not isinstance(event, BlockStored) or not event.block_hashes or not event.token_ids:
                continue
            hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
            if size * len(hashes) != len(tokens) or not isinstance(tokens[0], int):
                continue  # a partial page, or bigram (EAGLE) pages: not one flat run of whole pages
            for i, block_hash in enumerate(hashes):
                page = array(_TOKEN_TYPE, tokens[i * size:(i + 1) * size]).tobytes()
                if block_hash not in self._tokens:
                    new.append(block_hash)
                self._tokens[block_hash] = page
                self._tokens.move_to_end(block_hash)
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        self.learned += len(new)
        return new

    def get(self, block_hash: int) -> Optional[List[int]]:
        page = self._tokens.get(block_hash)
        if page is None:
            return None
        tokens = array(_TOKEN_TYPE)
        tokens.frombytes(page)
        return tokens.tolist()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)
