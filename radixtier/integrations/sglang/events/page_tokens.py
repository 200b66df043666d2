"""Token ids of the pages SGLang announced, learned from its own `BlockStored` events.

The storage backend receives page hashes, never tokens; a router matches a request to a worker by
hashing the request's tokens (Dynamo's indexer ignores a stored block that has none). SGLang's own
GPU/CPU events carry, for the same block hash, the page's tokens: this book keeps them for the
newest `capacity` pages (in one process SGLang's block hash of a page is the one tier 3 names it by,
when no extra_key or cache_salt namespaces the request), so tier-3 events can carry them honestly.

Memory: one bytes object (8 bytes a token) and one dict entry per page; 65,536 pages of 64 tokens
hold 32 MiB of token ids. Learned on one thread (the tier-3 events thread); `get` may be called from any
(a transfer thread tags the pages it writes): one lock, held for a lookup or one batch's lessons.
"""

from __future__ import annotations

import threading
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
        self._lock = threading.Lock()
        self.learned = 0

    def learn(self, events: Iterable[object]) -> List[int]:
        """Read one SGLang batch's BlockStored events; returns the hashes newly learned."""
        pages = []
        for event in events:
            if not isinstance(event, BlockStored) or not event.block_hashes or not event.token_ids:
                continue
            hashes, tokens, size = event.block_hashes, event.token_ids, event.block_size
            if size * len(hashes) != len(tokens) or not isinstance(tokens[0], int):
                continue  # a partial page, or bigram (EAGLE) pages: not one flat run of whole pages
            for i, block_hash in enumerate(hashes):
                pages.append((block_hash, array(_TOKEN_TYPE, tokens[i * size:(i + 1) * size]).tobytes()))
        return self._keep(pages)

    def put(self, block_hash: int, tokens: List[int]) -> None:
        """Tokens known from elsewhere (a page's tag read back from tier 3)."""
        self._keep([(block_hash, array(_TOKEN_TYPE, tokens).tobytes())])

    def _keep(self, pages: List[tuple]) -> List[int]:
        new: List[int] = []
        with self._lock:
            book = self._tokens
            for block_hash, page in pages:
                if block_hash not in book:
                    new.append(block_hash)
                book[block_hash] = page
                book.move_to_end(block_hash)
            while len(book) > self.capacity:
                book.popitem(last=False)
            self.learned += len(new)
        return new

    def get(self, block_hash: int) -> Optional[List[int]]:
        with self._lock:
            page = self._tokens.get(block_hash)
        if page is None:
            return None
        tokens = array(_TOKEN_TYPE)
        tokens.frombytes(page)
        return tokens.tolist()

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._tokens

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)
