"""Untrusted registry data: running the index's writes so that a foreign key never stops them.

Anyone who can write to Redis can replace a key with another type. A key of the wrong type is
replaced where it is ours to rebuild (the node set, the heartbeat hash, our own heartbeat and
pages hash, a GC lock nobody renews) and skipped where it is not; each such problem goes to the
problem log (health()["registry_problems"], logged at most once a minute). Owns that policy, for
every background writer (publishing, heartbeat, republication, garbage collection). Why a room of
its own: those writers share it, and it must read the same everywhere. Stateless apart from what
it reports to the Counters and Problems it is given.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, List, Tuple

from radixtier.storage.index.redis_conn import Client, pipeline, text, unavailable, wrong_type
from radixtier.storage.index.redis_health import Counters, Problems

PipeOp = Tuple[object, Callable[[Any], object]]  # (the key an op touches, the call adding it to a pipeline)


class Repair:
    """Runs writes on untrusted keys: a key of the wrong type is replaced (or only reported)."""

    def __init__(self, redis: ModuleType, cluster: bool, problems: Problems, counters: Counters,
                 own_pages_key: str, own_pages_replaced: Callable[[], None]) -> None:
        """own_pages_key: our pages hash; own_pages_replaced: called when it was replaced (what it
        listed, for unpublish and GC, comes back from the store by a republication)."""
        self._response_error = redis.ResponseError
        self._no_script = redis.exceptions.NoScriptError
        self._cluster = cluster
        self._problems, self._counters = problems, counters
        self._own_pages_key = own_pages_key
        self._own_pages_replaced = own_pages_replaced

    def pipe(self, client: Client, ops: List[PipeOp], repair: bool = True) -> list:
        """Run ops (the key each touches, the call adding it to a pipeline) in one pipeline;
        replies in order. A key of the wrong type is replaced and its op run again (repair=True),
        or reported and answered None (repair=False: an operator's read-only view); other errors
        that are not an outage are reported and answered None. An outage raises (see Link)."""
        pipe = pipeline(client, self._cluster)
        for _key, add in ops:
            add(pipe)
        replies = list(pipe.execute(raise_on_error=False))
        again, replaced = [], set()
        for i, ((key, add), reply) in enumerate(zip(ops, replies)):
            if isinstance(reply, Exception):
                if repair and wrong_type(reply):
                    if key not in replaced:
                        self.replace(client, key, reply)
                        replaced.add(key)
                    again.append(i)
                else:
                    replies[i] = self.settle(key, reply)
        if again:
            redo = self.pipe(client, [ops[i] for i in again], repair=False)
            for i, reply in zip(again, redo):
                replies[i] = reply
        return replies

    def settle(self, key: object, reply: Exception) -> None:
        """A failed reply of one op: an outage (or lost rights) is raised for the link to handle;
        anything else is reported (once a minute) and read as no answer."""
        if unavailable(reply) or isinstance(reply, self._no_script):
            raise reply
        bad_data = wrong_type(reply)
        self._problems.note(f"{text(key)}:{type(reply).__name__}", f"{text(key)}: {reply}",
                            kind="registry" if bad_data else "errors")
        return None

    def script_replies(self, calls: List[Tuple[str, str, list]], replies: list) -> list:
        """Replies of ScriptRunner.run with failures settled: an outage raises; a page whose script
        failed otherwise is reported and answered None (the rest of the batch stands)."""
        return [self.settle(key, r) if isinstance(r, Exception) else r for (_n, key, _a), r in zip(calls, replies)]

    def replace(self, client: Client, key: object, why: BaseException) -> None:
        """Delete a key of ours that holds another type than we keep there: it is rebuilt by its
        next write (the node set and heartbeat hash on every heartbeat, our pages hash by the
        caller), and nothing in it could be read."""
        client.delete(key)
        self._counters.add("registry_repairs")
        if key == self._own_pages_key:
            self._own_pages_replaced()  # what it listed (for unpublish and GC) comes back from the store
        name = text(key)
        self._problems.note(f"{name}:replaced", f"{name}: held the wrong type of value ({why}); replaced")

    def tolerant(self, client: Client, key: object, fn: Callable[[Client], Any], empty: object,
                 repair: bool = True) -> Any:
        """fn(client) on `key`; a key of the wrong type is replaced (or, repair=False, only
        reported) and `empty` returned, so one bad key never fails the work around it."""
        try:
            return fn(client)
        except self._response_error as exc:
            if not wrong_type(exc):
                raise
            if repair:
                self.replace(client, key, exc)
            else:
                self._problems.note(f"{text(key)}:wrong type", f"{text(key)}: {exc}")
            return empty
