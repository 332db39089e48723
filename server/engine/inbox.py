"""What other threads hand the engine: new requests and aborts, and the wake-up of an idle loop.

The engine loop runs in its own thread (async_engine.py); `put_*` may be called from any thread,
`drain` and `wait` only from the loop's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from server.engine.request import EngineRequest


class Inbox:
    def __init__(self) -> None:
        self._items: queue.SimpleQueue[EngineRequest | str] = queue.SimpleQueue()
        self._wakeup = threading.Event()

    def put_request(self, request: EngineRequest) -> None:
        self._items.put(request)
        self._wakeup.set()

    def put_abort(self, request_id: str) -> None:
        self._items.put(request_id)
        self._wakeup.set()

    def empty(self) -> bool:
        return self._items.empty()

    def wait(self, timeout: float) -> None:
        """Sleep until something arrives (or `timeout` seconds pass)."""
        if self._items.empty():
            self._wakeup.wait(timeout)
        self._wakeup.clear()

    def drain(self) -> Iterator[EngineRequest | str]:
        """Everything that arrived, in order: requests, and the ids of requests to abort."""
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return
