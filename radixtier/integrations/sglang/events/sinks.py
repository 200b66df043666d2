"""Where SGLang's own KV-event publisher meets the backend's tier-3 events, inside one scheduler.

With `--kv-events-config '{"publisher": "radixtier", ...}'` SGLang builds radixtier's publisher
(event_stream.py: SGLang's ZMQ publisher that also carries tier-3 events and tells radixtier the
token ids of the pages it announces). SGLang builds its tree cache -- and with it the storage
backend -- before its publisher, so the two meet here by callback: the backend asks to be told
(`when_offered`), the publisher offers itself when SGLang creates it (`offer`). A scheduler process
holds one KV cache and at most one publisher, so there is one slot.

Deliberately light (no SGLang import): the backend consults it whether or not events are on, and
with no radixtier publisher nothing here ever runs a callback.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional

log = logging.getLogger("radixtier.sglang")

_lock = threading.Lock()
_stream: Optional[Any] = None                  # the radixtier publisher SGLang created in this process
_waiting: List[Callable[[Any], None]] = []     # backends to tell when it appears


def offer(stream: Any) -> None:
    """Called by radixtier's publisher once SGLang created it: tells every waiting backend."""
    global _stream
    with _lock:
        _stream = stream
        waiting = list(_waiting)
        _waiting.clear()
    for callback in waiting:  # outside the lock: a callback may start threads
        _tell(callback, stream)


def _tell(callback: Callable[[Any], None], stream: Any) -> None:
    """Run one callback; its failure costs tier-3 events, never SGLang's publisher (whose
    constructor runs this on the scheduler thread)."""
    try:
        callback(stream)
    except Exception as exc:
        log.error("radixtier: tier-3 KV events could not join SGLang's stream: %s", exc)


def withdraw(stream: Any) -> None:
    """The publisher shut down: later backends will not find it."""
    global _stream
    with _lock:
        if _stream is stream:
            _stream = None


def when_offered(callback: Callable[[Any], None]) -> Callable[[], None]:
    """Run `callback(stream)` now if the publisher exists, else once it is offered. Returns a
    function that cancels a callback not yet run (the backend closing first)."""
    with _lock:
        stream = _stream
        if stream is None:
            _waiting.append(callback)
    if stream is not None:
        _tell(callback, stream)

    def cancel() -> None:
        with _lock:
            if callback in _waiting:
                _waiting.remove(callback)
    return cancel
