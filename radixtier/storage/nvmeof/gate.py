"""CallGate: the calls that may reach the device right now, so close() can wait for them.

A transfer thread of SGLang may still be inside get/put when the backend is closed; the gate
counts such calls, refuses new ones once closing, and tells close() whether the running ones
finished in time (if not, the store keeps its lease marked open rather than pull the device
from under them).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class CallGate:
    """Counts calls that may reach the device; close() waits for them, and none starts after it.
    (A transfer thread of SGLang may still be inside get/put when the backend is closed.)"""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._active = 0
        self._closing = False

    @contextmanager
    def call(self, path: str) -> Iterator[None]:
        with self._cv:
            if self._closing:
                raise RuntimeError(f"{path}: the page store is closed")
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @property
    def closing(self) -> bool:
        with self._cv:
            return self._closing

    def close(self, timeout: float) -> bool:
        """Refuse new calls; True once the running ones finished (False: still running at timeout)."""
        with self._cv:
            self._closing = True
            return self._cv.wait_for(lambda: self._active == 0, timeout=timeout)
