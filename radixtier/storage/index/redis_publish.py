"""The prefix index's asynchronous publish pipeline: a bounded queue the serving path appends to, and
the batches the background worker drains from it into Redis.

Owns the queue of publish/unpublish operations (and what is in flight), how a drained batch
becomes writer scripts (one per page, pipelined: see redis_scripts.py) plus root pointers and our
pages hash, and what happens when a batch fails: an outage puts it back for after the
reconnection, any other failure is retried a few times and then dropped (a republication restores
it), and health() says so meanwhile. Why a room of its own: serving never waits on Redis for
writes; this is the boundary where a request's publish becomes background work.

Lock: the queue's condition `_queue_cv` (over `_lock`) is the only lock here. While holding it
this module may count and note problems (Counters' and Problems' locks are leaves), never the
reverse, and never does I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from radixtier.storage.api import PageRecord
from radixtier.storage.index.records import ENTRY_BYTES, MAX_HOLDERS, encode_record, node_field
from radixtier.storage.index.redis_conn import Client, Down, Link, delete_each, is_hex, text
from radixtier.storage.index.redis_health import Counters, Problems
from radixtier.storage.index.redis_keys import Keys
from radixtier.storage.index.redis_repair import PipeOp, Repair
from radixtier.storage.index.redis_scripts import Call, ScriptRunner

BATCH_RETRIES = 20  # a batch that fails this often in a row (not a connection loss) is dropped
ROOT_PTR_TTL_S = 7 * 24 * 3600  # refreshed by every publish (and republish) of the page

Op = Tuple[str, tuple]  # ("pub", (root, key, record)) or ("unpub", (key,))


class PublishQueue:
    """The publish queue and its drain; publish()/unpublish() never touch Redis."""

    def __init__(self, writer: Link, keys: Keys, node_id: str, queue_limit: int, cluster: bool,
                 scripts: ScriptRunner, repair: Repair, counters: Counters, problems: Problems) -> None:
        self._writer, self._keys, self._node_id = writer, keys, node_id
        self._queue_limit = queue_limit
        self._cluster = cluster
        self._scripts, self._repair = scripts, repair
        self._counters, self._problems = counters, problems
        self._me_field = node_field(node_id)
        self._lock = threading.Lock()
        self._queue: Deque[Op] = deque()
        self._queue_cv = threading.Condition(self._lock)
        self._inflight_ops = 0
        self._batch_failures = 0  # the worker's alone
        self.last_error = ""  # the last drained batch's failure ("" once one succeeds)

    # ---------------------------------------------------------------- the serving side
    def publish(self, root: bytes, keys: Sequence[bytes], records: Sequence[PageRecord]) -> None:
        if len(keys) != len(records):
            raise ValueError(f"publish: {len(keys)} keys but {len(records)} records")
        self.enqueue([("pub", (bytes(root), bytes(k), r)) for k, r in zip(keys, records)])

    def unpublish(self, keys: Sequence[bytes]) -> None:
        self.enqueue([("unpub", (bytes(k),)) for k in keys])

    def enqueue(self, ops: List[Op]) -> None:
        with self._queue_cv:
            self._queue.extend(ops)
            over = len(self._queue) - self._queue_limit
            for _ in range(max(0, over)):  # bounded: the oldest go; re-publication reconciles what they changed
                self._queue.popleft()
            if over > 0:
                self._counters.add("dropped_ops", over)
            self._queue_cv.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until queued publishes reached Redis (False if Redis is down or time ran out)."""
        deadline = time.monotonic() + timeout
        with self._queue_cv:
            while self._queue or self._inflight_ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue_cv.wait(min(left, 0.05))
        return True

    def depth(self) -> int:
        with self._lock:
            return len(self._queue)

    def wait_for_work(self, timeout: float, stop: threading.Event) -> None:
        """The worker's idle wait: until something is queued, `stop` is set (seen within 50 ms at
        the latest, the caller's timeout) or `timeout` passed."""
        with self._queue_cv:
            if not self._queue and not stop.is_set():
                self._queue_cv.wait(timeout=timeout)

    # ---------------------------------------------------------------- the worker's side
    def drain(self, batch: int = 2000) -> None:
        while True:
            with self._queue_cv:
                if not self._queue:
                    self._queue_cv.notify_all()
                    return
                ops = [self._queue.popleft() for _ in range(min(batch, len(self._queue)))]
                self._inflight_ops = len(ops)
            try:
                self.apply_batch(ops)
            except Down:
                with self._queue_cv:  # put them back, in order, for after the reconnection
                    self._queue.extendleft(reversed(ops))
                    self._inflight_ops = 0
                raise
            except Exception as exc:  # e.g. a server error that is not an outage: retry a few times
                self._batch_failures += 1
                self._publish_failed(exc)
                with self._queue_cv:
                    if self._batch_failures < BATCH_RETRIES:
                        self._queue.extendleft(reversed(ops))
                    else:
                        self._batch_failures = 0
                        self._counters.add("dropped_ops", len(ops))
                        self._problems.note("dropped", f"dropped {len(ops)} index updates after {BATCH_RETRIES} "
                                            f"failed attempts (re-publication after the next reconnection restores "
                                            f"them)", level=logging.ERROR, kind="errors")
                    self._inflight_ops = 0
                    self._queue_cv.notify_all()
                raise
            self._batch_failures = 0
            self.last_error = ""
            with self._queue_cv:
                self._inflight_ops = 0
                self._queue_cv.notify_all()

    def _publish_failed(self, exc: BaseException) -> None:
        """A drained batch failed without an outage: health() says so (writer_up False,
        last_publish_error) until a batch succeeds; logged once a minute."""
        self._counters.add("publish_failures")
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._problems.note("publish", f"prefix index publish failed, retrying: {self.last_error}",
                            kind="errors")

    def apply_batch(self, ops: List[Op]) -> None:
        """One drained batch: each op sets or removes our entry in one page's value (a script per
        page, pipelined). An unpublished page's owned entry goes only once its value no longer holds
        us: a batch that fails half-way (OOM, a shard down) is retried with its roots intact."""
        keys, repair = self._keys, self._repair
        owned = keys.owned(self._node_id)
        roots = self._published_roots([args[0] for kind, args in ops if kind == "unpub"])
        steps: List[Tuple[str, bytes, Optional[bytes]]] = []  # (kind, key, root) in order
        for kind, args in ops:
            if kind == "pub":
                root, key, _rec = args
                roots[key] = root  # a later unpublish in this batch must find this record
                steps.append(("pub", key, root))
            else:
                steps.append(("unpub", args[0], roots.pop(args[0], None)))

        calls: List[Call] = []
        for (kind, key, root), (_k, args) in zip(steps, ops):
            if kind == "pub":
                calls.append(("upsert", keys.page(root, key),
                              [self._me_field, encode_record(args[2]), ENTRY_BYTES, MAX_HOLDERS]))
            elif root is not None:
                calls.append(("remove", keys.page(root, key), [self._me_field, ENTRY_BYTES]))

        def run(client: Client) -> list:
            replies = repair.script_replies(calls, self._scripts.run(client, calls))
            writes: List[PipeOp] = []
            for kind, key, root in steps:
                if kind == "pub":
                    # a page's root is a function of its content (chained hashes), the same for every
                    # node: the pointer is never wrong, only possibly stale, so it just expires
                    ptr = keys.root_ptr(key)
                    writes.append((ptr, lambda p, ptr=ptr, root=root: p.set(ptr, root, ex=ROOT_PTR_TTL_S)))
                    writes.append((owned, lambda p, key=key, root=root: p.hset(owned, key.hex(), root.hex())))
            if writes:
                repair.pipe(client, writes)  # a pages hash of the wrong type is replaced and written again
            return replies

        replies = iter(self._writer.call(run))
        last: Dict[bytes, Tuple[str, object]] = {}  # key -> (its last op in this batch, that op's reply)
        for kind, key, root in steps:
            last[key] = (kind, next(replies) if kind == "pub" or root is not None else None)
        unpub = [key for key, (kind, _r) in last.items() if kind == "unpub"]
        orphans = [key for key in unpub if not last[key][1]]  # nobody holds it now (or it was never ours)
        if unpub:
            self._writer.call(lambda c: repair.tolerant(c, owned, lambda c: c.hdel(owned, *[k.hex() for k in unpub]),
                                                        0))
        if orphans:
            self._writer.call(lambda c: delete_each(c, [keys.root_ptr(k) for k in orphans], self._cluster))
        n_pub = sum(1 for k, _ in ops if k == "pub")
        self._counters.add("published", n_pub)
        self._counters.add("unpublished", len(ops) - n_pub)

    def _published_roots(self, keys: List[bytes]) -> Dict[bytes, bytes]:
        """Roots under which `keys` were published (from our owned-pages hash), for unpublishing them."""
        if not keys:
            return {}
        owned = self._keys.owned(self._node_id)
        vals = self._writer.call(lambda c: self._repair.tolerant(
            c, owned, lambda c: c.hmget(owned, [k.hex() for k in keys]), [None] * len(keys)))
        return {k: bytes.fromhex(text(v)) for k, v in zip(keys, vals) if v and is_hex(text(v), 32)}
