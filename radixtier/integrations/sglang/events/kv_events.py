"""Tier-3 KV events: what this node's partition holds, told to the fleet's router in SGLang's own
wire format (`BlockStored` / `BlockRemoved` with medium DISK, `AllBlocksCleared`).

SGLang 0.5.23 emits KV events for its GPU and CPU tiers only; a KV-aware router (Dynamo's, llm-d's,
SGLang's gateway) therefore never learns that a node's prefix sits in tier 3. This module fills
that gap with SGLang's own event classes, in one of two streams:

- **joined** (recommended): SGLang's `--kv-events-config` selects radixtier's publisher
  (event_stream.py); tier-3 events go into SGLang's own stream, one sequence per worker, and the
  publisher shows this module SGLang's batches, from which it learns each page's token ids
  (page_tokens.py) and sees SGLang's `AllBlocksCleared` (a `/flush_cache`): routers take that as
  "this worker holds nothing", so what tier 3 still holds is announced again right after it. A
  backend `clear()` is announced as `BlockRemoved` (DISK) of its pages, never as `AllBlocksCleared`,
  which would also wipe the router's view of the worker's GPU and CPU tiers;
- **own**: extra_config `kv_events_endpoint`: a stream of tier-3 events alone, on SGLang's
  `ZmqEventPublisher` (with a replay socket if `kv_events_replay_endpoint` is set). Token ids come
  along when SGLang also uses radixtier's publisher; otherwise `token_ids` is empty.

What the events say, and what they cannot:
- block hashes are SGLang's: `hash_str_to_int64(key)` of the page-hash string SGLang hands the
  backend, the same number SGLang's GPU/CPU events carry for that page when no `extra_key` or
  `cache_salt` namespaces the request (with one, SGLang hashes its events with a seed the backend
  never sees, and the two streams name the page differently);
- `parent_block_hash` is the previous page of the call's chain (the last prefix key for the first);
- `token_ids`: when SGLang's own events taught them (the newest `TOKEN_PAGES` pages). A page whose
  tokens are not known yet waits for them up to `token_wait_s` (in order, so a chain's pages are
  never announced before their parents), then is announced without tokens and counted
  (`stored_without_tokens`; Dynamo's indexer ignores such a block);
- a page tier 3 evicts is announced as `BlockRemoved` when this process named it recently enough to
  remember its hash (the newest `remembered_pages`); older evictions are counted as
  `removals_unnamed` and not announced;
- **what tier 3 already holds** (`holdings`: the store's `router_tags`, read back from the tags each
  page was written with -- see `tags_for`) is announced when the events start (a restarted worker's
  partition) and again after SGLang's `AllBlocksCleared`, parents first, by a thread of its own in
  bounded batches: it waits while the queue is half full and rests as long as each batch took, so it
  takes at most half a core. A page evicted while it is being announced is never announced
  (`removed` during an announcement is remembered until it ends); a backend `clear()` stops it.

Cost: nothing when off (this module is not even imported). When on, a transfer thread or SGLang's
scheduler thread only appends one small record per batch to a bounded queue and never waits: a full
queue drops the record and counts it (`dropped`); one thread builds the events and hands them to
the publisher (whose own queue may block that thread, never a transfer).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from sglang.srt.disaggregation.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                                 KVEventBatch, StorageMedium, ZmqEventPublisher)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from radixtier.integrations.sglang.events.stream import RadixtierEventPublisher
from radixtier.integrations.sglang.events.page_tokens import TOKEN_PAGES, PageTokens
from radixtier.storage.api import RouterTag, TaggedPage

log = logging.getLogger("radixtier.sglang")

DEFAULT_TOPIC = "radixtier"
QUEUE_BATCHES = 4096          # records waiting for the events thread before new ones are dropped
REMEMBERED_PAGES = 1 << 16    # store key -> (SGLang block hash, parent), for evictions and re-announcing
TOKEN_WAIT_S = 2.0            # how long a stored page waits for SGLang to tell its tokens
# A restarted worker's first announcement waits this long after its stream opened: a router's ZMQ
# subscriber reconnects every 100 ms (ZMQ's default), and a PUB socket drops what it sends before then.
ANNOUNCE_AFTER_S = 1.0
# An empty batch after this long without one: a subscriber that joined late (a router re-registering
# a restarted worker, its reconnect backed off) sees the sequence gap at once and asks the replay
# socket for what it missed -- the announcement of what tier 3 holds included.
HEARTBEAT_S = 5.0
DISK = StorageMedium.DISK.value


@dataclass(frozen=True)
class EventsConfig:
    """Where tier-3 events go on their own: extra_config `kv_events_endpoint` ('' = not on their
    own), `kv_events_replay_endpoint`, `kv_events_topic`. The endpoint's port is offset by the DP
    rank, as SGLang's own publisher does."""

    endpoint: str = ""
    replay_endpoint: str = ""
    topic: str = DEFAULT_TOPIC


# queued records: ("stored", keys, parent_key, store_keys, ok, chained) | ("removed", store_keys) |
# ("cleared",) | ("sglang", batch) | ("held", generation, again, pages) | ("held_end", generation)
_Record = Tuple
_Page = Tuple[int, Optional[int]]             # (block hash, parent block hash)
_Named = Tuple[int, Optional[int], bool]      # (block hash, parent block hash, announced yet)
_MUST_KEEP = 4                                # removals and clears may exceed the queue's bound this many times
Holdings = Callable[[], Iterable[List[TaggedPage]]]  # what tier 3 holds, named, parents first, in batches


class Tier3Events:
    """One per KV cache (DP rank); build it with `own_stream` or `joined_to`. Thread-safe.

    State owned by the events thread alone: `_names` (store key -> what it was announced as; the
    newest `remembered_pages`), `_waiting` (hash -> (parent, deadline, store key): stored pages
    waiting for their tokens, oldest first), `_gone` (store keys removed while holdings are being
    announced), `_held_live` (the announcement whose records count). `_tokens` is learned there and
    read by `tags_for` on any thread (its own lock). Under `_cv`: the queue, `_running`, `_in_hand`,
    `_stream`, `counters`, `_held_gen` (the newest announcement started). The events thread never
    holds `_cv` while it builds or publishes events; the announcing thread never holds it while it
    reads tier 3."""

    def __init__(self, publish: Callable[[EventBatch], None], block_size: int, *, joined: bool,
                 close_sink: Optional[Callable[[], None]] = None, remembered_pages: int = REMEMBERED_PAGES,
                 queue_batches: int = QUEUE_BATCHES, token_pages: int = TOKEN_PAGES,
                 token_wait_s: float = TOKEN_WAIT_S, holdings: Optional[Holdings] = None,
                 announce_after_s: float = ANNOUNCE_AFTER_S, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.block_size = block_size
        self.joined = joined
        self._publish = publish
        self._close_sink = close_sink
        self._remembered_pages = remembered_pages
        self._token_wait_s = token_wait_s
        self._queue: Deque[_Record] = deque()
        self._queue_batches = queue_batches
        self._cv = threading.Condition(threading.Lock())
        self._running = True
        self._in_hand = False  # a record is being turned into events (for flush)
        self._stream: Optional[RadixtierEventPublisher] = None  # the publisher we learn tokens from
        self._names: "OrderedDict[bytes, _Named]" = OrderedDict()
        self._waiting: "OrderedDict[int, Tuple[Optional[int], float, bytes]]" = OrderedDict()
        self._tokens = PageTokens(token_pages)
        self._holdings = holdings
        self._announce_after_s = announce_after_s
        self._heartbeat_s = heartbeat_s  # 0: none
        self._last_batch = time.monotonic()  # events thread: when the stream last carried a batch
        self._held_gen = 0
        self._held_live = 0
        self._announcing = 0  # announcing threads not yet finished (under _cv)
        self._gone: Set[bytes] = set()
        self.counters: Dict[str, int] = {"batches": 0, "blocks_stored": 0, "blocks_removed": 0, "cleared": 0,
                                         "dropped": 0, "removals_unnamed": 0, "errors": 0, "reannounced": 0,
                                         "stored_without_tokens": 0, "sglang_batches_seen": 0,
                                         "held_announced": 0, "held_announcements": 0, "held_ms": 0, "heartbeats": 0}
        self._thread = threading.Thread(target=self._events_thread_func, name="radixtier-kv-events", daemon=True)
        self._thread.start()
        if holdings is not None:
            self.announce_holdings()

    @classmethod
    def own_stream(cls, config: EventsConfig, block_size: int, dp_rank: int = 0, **options) -> "Tier3Events":
        """Tier-3 events on their own ZMQ stream (SGLang's publisher, owned and closed by us)."""
        publisher = ZmqEventPublisher(dp_rank, endpoint=config.endpoint,
                                      replay_endpoint=config.replay_endpoint or None, topic=config.topic)

        def close() -> None:
            publisher.shutdown()
            atexit.unregister(publisher.shutdown)  # SGLang registers it; a second call waits 1 s for nothing
        return cls(publisher.publish, block_size, joined=False, close_sink=close, **options)

    @classmethod
    def joined_to(cls, stream: RadixtierEventPublisher, block_size: int, **options) -> "Tier3Events":
        """Tier-3 events inside SGLang's own stream, with tokens learned from it."""
        holdings = options.pop("holdings", None)
        events = cls(stream.publish_tier3, block_size, joined=True, **options)
        events.learn_from(stream)
        if holdings is not None:  # after learning is on: SGLang's own events of the same pages teach nothing new
            events._holdings = holdings
            events.announce_holdings()
        return events

    def learn_from(self, stream: RadixtierEventPublisher) -> None:
        """Learn token ids (and see clears) from every batch SGLang publishes through `stream`."""
        with self._cv:
            self._stream = stream
        stream.observe(self.observed)

    # ------------------------------------------------------------------ called on other threads
    def tags_for(self, keys: Sequence[str], parent_key: Optional[str], chained: bool = True) -> List[Optional[RouterTag]]:
        """What to write with each page of a write call, so a restarted worker can announce it:
        (block hash, parent block hash, the token ids SGLang's events taught -- () if not yet).
        None for a key that is not an SGLang page hash. Never waits."""
        tags: List[Optional[RouterTag]] = []
        prev = _block_hash(parent_key) if parent_key is not None and chained else None
        for key in keys:
            h = _block_hash(key)
            tags.append(None if h is None else (h, prev, self._tokens.get(h) or ()))
            prev = h if chained else None
        return tags

    def announce_holdings(self) -> bool:
        """Announce what tier 3 holds (again), on a thread of its own; one started earlier stops at
        its next batch. False without holdings or once closed."""
        with self._cv:
            if self._holdings is None or not self._running:
                return False
            self._held_gen += 1
            gen = self._held_gen
            self._announcing += 1
            self.counters["held_announcements"] += 1
            again = self.counters["held_announcements"] > 1
        threading.Thread(target=self._announce_thread_func, args=(gen, again), daemon=True,
                         name="radixtier-kv-announce").start()
        return True

    def _announce_thread_func(self, gen: int, again: bool) -> None:
        if not again:
            with self._cv:  # the stream just opened: let subscribers (re)connect first
                self._cv.wait_for(lambda: not self._running, self._announce_after_s)
        t0 = time.monotonic()
        self._put_held(("held", gen, again, []), gen)  # from here on removals are remembered
        try:
            for pages in self._holdings():
                t = time.monotonic()
                if not self._put_held(("held", gen, again, pages), gen):
                    return
                time.sleep(time.monotonic() - t)  # rest as long as the batch took: at most half a core
        except Exception as exc:  # a store closing under us, an I/O error: the announcement stops
            with self._cv:
                self.counters["errors"] += 1
            log.error("radixtier: announcing what tier 3 holds stopped: %s", exc)
        finally:
            self._put_held(("held_end", gen), gen)
            with self._cv:
                self.counters["held_ms"] += int((time.monotonic() - t0) * 1000)
                self._announcing -= 1
                self._cv.notify_all()

    def _put_held(self, record: _Record, gen: int) -> bool:
        """Queue one announcement record, waiting while the queue is half full; False once this
        announcement was overtaken or the events closed."""
        with self._cv:
            while (self._running and gen == self._held_gen and record[0] == "held"
                   and len(self._queue) >= self._queue_batches // 2):
                self._cv.wait(0.1)
            if not self._running or (gen != self._held_gen and record[0] == "held"):
                return False
            self._queue.append(record)
            self._cv.notify_all()
            return True

    def stored(self, keys: Sequence[str], parent_key: Optional[str], store_keys: Sequence[bytes],
               ok: Sequence[bool], chained: bool = True) -> None:
        """Pages of one write call: keys[i] (SGLang's hash string) is durable where ok[i]. chained:
        the keys are one chain (each page's parent is the one before it); else each is parentless."""
        if any(ok):
            self._put(("stored", list(keys), parent_key, list(store_keys), list(ok), chained))

    def removed(self, store_keys: Sequence[bytes]) -> None:
        """Pages tier 3 evicted or dropped (store keys)."""
        if store_keys:
            self._put(("removed", list(store_keys)))

    def cleared(self) -> None:
        self._put(("cleared",))

    def observed(self, batch: EventBatch) -> None:
        """A batch SGLang published (its scheduler thread): queued, never waited for."""
        self._put(("sglang", batch))

    def _put(self, record: _Record) -> None:
        with self._cv:
            if not self._running:
                return
            if len(self._queue) >= self._queue_batches and not (
                    len(self._queue) < self._queue_batches * _MUST_KEEP and self._must_keep(record)):
                self.counters["dropped"] += 1
                return
            self._queue.append(record)
            self._cv.notify()

    @staticmethod
    def _must_keep(record: _Record) -> bool:
        """Records whose loss would leave the router wrong for good (a removal, a clear; SGLang's
        flush, after which tier 3 is announced again), kept past the bound (up to _MUST_KEEP times
        it); a dropped store or token lesson only costs an announcement."""
        kind = record[0]
        return kind in ("removed", "cleared") or (
            kind == "sglang" and any(isinstance(e, AllBlocksCleared) for e in record[1].events))

    # ------------------------------------------------------------------ the events thread
    def _events_thread_func(self) -> None:
        while True:
            with self._cv:
                while self._running and not self._queue:
                    now, due = time.monotonic(), []
                    if self._waiting:  # the oldest waiting page's deadline
                        due.append(next(iter(self._waiting.values()))[1])
                    if self._heartbeat_s > 0:
                        due.append(self._last_batch + self._heartbeat_s)
                    if not due:
                        self._cv.wait()
                        continue
                    if min(due) <= now:
                        break
                    self._cv.wait(min(due) - now)
                closing = not self._queue and not self._running
                record = self._queue.popleft() if self._queue else None
                self._in_hand = True
            try:
                events = self._events(record) if record is not None else []
                events += self._waiting_out(force=closing)
                now = time.monotonic()
                if record is not None and record[0] == "sglang":
                    self._last_batch = now  # SGLang's own batch went out on the stream
                heartbeat = (not events and not closing and self._heartbeat_s > 0
                             and now - self._last_batch >= self._heartbeat_s)
                if events or heartbeat:
                    self._publish(KVEventBatch(ts=time.time(), events=events))
                    self._last_batch = now
                    with self._cv:
                        self.counters["heartbeats" if heartbeat else "batches"] += 1
            except Exception as exc:  # a publisher failure costs events, never a transfer
                with self._cv:
                    self.counters["errors"] += 1
                log.error("radixtier: tier-3 KV event not published: %s", exc)
            with self._cv:
                self._in_hand = False
                self._cv.notify_all()
            if closing:
                return

    def _events(self, record: _Record) -> List[object]:
        kind = record[0]
        if kind == "sglang":
            return self._seen_sglang(record[1])
        if kind == "cleared":
            return self._cleared()
        if kind == "removed":
            return self._removed(record[1])
        if kind == "held":
            return self._held(*record[1:])
        if kind == "held_end":
            if record[1] == self._held_live:
                self._held_live, self._gone = 0, set()
            return []
        _kind, keys, parent_key, store_keys, ok, chained = record
        fresh: List[Tuple[int, Optional[int], bytes]] = []
        prev = None if parent_key is None or not chained else hash_str_to_int64(parent_key)
        for key, sk, good in zip(keys, store_keys, ok):
            h = hash_str_to_int64(key)
            if good:
                if sk in self._names:  # announced already, or waiting for its tokens: said once
                    self._names.move_to_end(sk)
                else:
                    self._remember(sk, (h, prev, False))
                    fresh.append((h, prev, sk))
            prev = h if chained else None
        return self._announce(fresh)

    def _announce(self, pages: List[Tuple[int, Optional[int], bytes]]) -> List[object]:
        """New stored pages: announced now with their tokens, or queued until SGLang tells them."""
        with self._cv:
            learning = self._stream is not None
        if not learning:  # nobody can tell us tokens: announce as they are
            return self._announced(pages)
        deadline = time.monotonic() + self._token_wait_s
        for h, parent, sk in pages:
            if h not in self._waiting:  # never moved: a page stays behind its parent
                self._waiting[h] = (parent, deadline, sk)
        return []

    def _waiting_out(self, force: bool) -> List[object]:
        """Waiting pages, oldest first, whose tokens are known or whose time is up (all if force)."""
        now, out = time.monotonic(), []
        while self._waiting:
            h, (parent, deadline, sk) = next(iter(self._waiting.items()))
            if h not in self._tokens and deadline > now and not force:
                break
            del self._waiting[h]
            if sk in self._names:  # not evicted while it waited
                out.append((h, parent, sk))
        return self._announced(out)

    def _announced(self, pages: List[Tuple[int, Optional[int], bytes]]) -> List[object]:
        for h, parent, sk in pages:
            if sk in self._names:
                self._names[sk] = (h, parent, True)
        return self._block_stored_runs([(h, parent) for h, parent, _sk in pages])

    def _held(self, gen: int, again: bool, pages: List[TaggedPage]) -> List[object]:
        """A batch of what tier 3 holds: announced unless removed since the announcement began,
        still waiting for its tokens, or (the first time) announced already since start."""
        if gen != self._held_live:
            if gen < self._held_live or pages:
                return []  # an overtaken announcement, or not begun: its start record opens it
            self._held_live, self._gone = gen, set()
            return []
        out: List[_Page] = []
        known: List[Optional[List[int]]] = []
        for sk, h, parent, tokens in pages:
            named = self._names.get(sk)
            if sk in self._gone or (named is not None and (not named[2] or not again)):
                continue
            self._remember(sk, (h, parent, True))
            out.append((h, parent))
            known.append(tokens or None)
        with self._cv:
            self.counters["held_announced"] += len(out)
            if again:
                self.counters["reannounced"] += len(out)
        return self._block_stored_runs(out, known) if out else []

    def _seen_sglang(self, batch: EventBatch) -> List[object]:
        with self._cv:
            self.counters["sglang_batches_seen"] += 1
        self._tokens.learn(batch.events)
        if not self.joined or not any(isinstance(e, AllBlocksCleared) for e in batch.events):
            return []
        if self._holdings is not None:  # tier 3 is read back: every page it holds, not only the remembered
            self.announce_holdings()
            return []
        # SGLang's device and host were flushed; routers forget every tier of this worker. Tier 3
        # still holds its pages: say so again, parents first (pages still waiting come later anyway).
        pages = parents_first([(h, parent) for h, parent, announced in self._names.values() if announced])
        with self._cv:
            self.counters["reannounced"] += len(pages)
        return self._block_stored_runs(pages)

    def _removed(self, store_keys: Sequence[bytes]) -> List[object]:
        hashes, unnamed = [], 0
        if self._held_live:
            self._gone.update(store_keys)
        for sk in store_keys:
            named = self._names.pop(sk, None)
            if named is None:
                unnamed += 1
            elif named[2]:
                hashes.append(named[0])
            else:  # never announced: it leaves the queue instead
                self._waiting.pop(named[0], None)
        with self._cv:
            self.counters["blocks_removed"] += len(hashes)
            self.counters["removals_unnamed"] += unnamed
        return [BlockRemoved(block_hashes=hashes, medium=DISK)] if hashes else []

    def _cleared(self) -> List[object]:
        announced = [h for h, _parent, was in self._names.values() if was]
        self._names.clear()
        self._waiting.clear()
        with self._cv:
            self._held_gen += 1  # an announcement under way stops: tier 3 is empty
        self._held_live, self._gone = 0, set()
        with self._cv:
            self.counters["cleared"] += 1
            if self.joined:
                self.counters["blocks_removed"] += len(announced)
        if not self.joined:
            return [AllBlocksCleared()]
        # in SGLang's stream AllBlocksCleared would also wipe the router's view of GPU and CPU
        return [BlockRemoved(block_hashes=announced, medium=DISK)] if announced else []

    def _block_stored_runs(self, pages: List[_Page],
                           known: Optional[List[Optional[List[int]]]] = None) -> List[BlockStored]:
        """BlockStored events for `pages` (in order): a run continues while each page's parent is
        the page before it and tokens are known for all of the run or for none. known[i]: page i's
        tokens when the caller has them (read back from tier 3), else SGLang's events taught them."""
        events: List[BlockStored] = []
        run: List[int] = []
        run_tokens: List[int] = []
        run_parent: Optional[int] = None
        run_has_tokens = False
        for i, (h, parent) in enumerate(pages):
            tokens = (known[i] if known is not None else None) or self._tokens.get(h)
            if run and (parent != run[-1] or (tokens is not None) != run_has_tokens):
                events.append(self._block_stored(run, run_parent, run_tokens))
                run, run_tokens = [], []
            if not run:
                run_parent, run_has_tokens = parent, tokens is not None
            run.append(h)
            run_tokens.extend(tokens or ())
        if run:
            events.append(self._block_stored(run, run_parent, run_tokens))
        with self._cv:
            self.counters["blocks_stored"] += len(pages)
            self.counters["stored_without_tokens"] += sum(len(e.block_hashes) for e in events if not e.token_ids)
        return events

    def _block_stored(self, hashes: List[int], parent: Optional[int], tokens: List[int]) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=self.block_size, lora_id=None, medium=DISK)

    def _remember(self, store_key: bytes, named: _Named) -> None:
        names = self._names
        names[store_key] = named
        if len(names) > self._remembered_pages:
            names.popitem(last=False)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far was handed to the publisher, no page waits for its
        tokens and no announcement of what tier 3 holds is under way (tests, benchmarks); False on
        timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._in_hand or self._waiting or self._announcing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.05))
            return True

    # ------------------------------------------------------------------ closing
    def stats(self) -> Dict[str, int]:
        with self._cv:
            return dict(self.counters, queued=len(self._queue), waiting_for_tokens=len(self._waiting),
                        pages_with_tokens=len(self._tokens))

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued (up to `timeout`), stop learning, close an own stream. Joined to
        SGLang's stream, the pages announced are removed first: a detached backend loads nothing."""
        if self.joined:
            self.cleared()
        with self._cv:
            self._running = False
            stream, self._stream = self._stream, None
            self._cv.notify_all()
        if stream is not None:
            stream.unobserve(self.observed)
        self._thread.join(timeout)
        if self._close_sink is not None:
            self._close_sink()


def _block_hash(key: str) -> Optional[int]:
    """SGLang's event hash of a page-hash string, or None for a key that is not one."""
    try:
        return hash_str_to_int64(key)
    except (ValueError, TypeError):
        return None


def parents_first(pages: List[_Page]) -> List[_Page]:
    """`pages` reordered so that a page whose parent is among them comes after that parent (a
    router drops a stored block whose parent it does not know); otherwise in the given order."""
    by_hash = {h: parent for h, parent in pages}
    out: List[_Page] = []
    done: set = set()
    for h, _parent in pages:
        chain = []
        while h is not None and h in by_hash and h not in done:
            chain.append(h)
            done.add(h)
            h = by_hash[h]
        for x in reversed(chain):
            out.append((x, by_hash[x]))
    return out
