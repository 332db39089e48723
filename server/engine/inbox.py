"""What other threads hand the engine: new requests, aborts and adapter unloads, and the wake-up of
an idle loop.

The engine loop runs in its own thread (async_engine.py); `put_*` may be called from any thread,
`drain` and `wait` only from the loop's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from server.engine.request import EngineRequest


@dataclass(frozen=True)
class UnloadAdapter:
    """A LoRA adapter removed from the served names, to forget once the requests submitted
    before its removal (ahead of this in the inbox) have its weights."""

    key: str


InboxItem = EngineRequest | str | UnloadAdapter


class Inbox:
    def __init__(self) -> None:
        self._items: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._wakeup = threading.Event()

    def put_request(self, request: EngineRequest) -> None:
        self._items.put(request)
        self._wakeup.set()

    def put_abort(self, request_id: str) -> None:
        self._items.put(request_id)
        self._wakeup.set()

    def put_unload(self, key: str) -> None:
        self._items.put(UnloadAdapter(key))
        self._wakeup.set()

    def empty(self) -> bool:
        return self._items.empty()

    def wait(self, timeout: float) -> None:
        """Sleep until something arrives (or `timeout` seconds pass)."""
        if self._items.empty():
            self._wakeup.wait(timeout)
        self._wakeup.clear()

    def drain(self) -> Iterator[InboxItem]:
        """Everything that arrived, in order: requests, the ids of requests to abort, adapters
        to unload."""
        while True:
            try:
                yield self._items.get_nowait()
            except queue.Empty:
                return
