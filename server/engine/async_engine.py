"""Runs the engine loop in its own thread and gives each request an async stream of outputs.

The model step never runs on the asyncio event loop, so HTTP stays responsive during a step.
Outputs cross back into per-request asyncio.Queues in batches: everything the engine emitted since
its last flush travels in one `loop.call_soon_threadsafe` (one wake-up of the event loop, not one
per row: at 256 streaming rows that was 256 self-pipe writes per step, each waking the loop to
fight the engine thread for the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable

import torch

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.engine.client import AdapterLoadError, EngineDead, KVCapacity, stream_outputs
from server.engine.engine import Engine
from server.engine.request import EngineRequest, RequestOutput
from server.logs import request_id_var

log = logging.getLogger(__name__)


Delivery = tuple["asyncio.Queue[RequestOutput]", RequestOutput]


def _deliver(deliveries: list[Delivery]) -> None:
    """On the event loop: put each output into its request's queue."""
    for queue, out in deliveries:
        queue.put_nowait(out)


class AsyncEngine:
    """An EngineClient (server/engine/client.py) over an engine stepped in a thread of this
    process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="beamline-engine", daemon=True)
        self.error: BaseException | None = None
        self._warm_up: Callable[[], None] | None = None
        self._warmed = threading.Event()
        # outputs emitted in the engine thread and not yet handed to their event loops
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Delivery]] = []
        engine.flush_outputs = self._flush

    def _flush(self) -> None:
        """Hand the outputs emitted since the last flush to their event loops, one call each."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        by_loop: defaultdict[asyncio.AbstractEventLoop, list[Delivery]] = defaultdict(list)
        for loop, delivery in batch:
            by_loop[loop].append(delivery)
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:  # the consumers' event loop is gone: nobody will read these
                for _, out in deliveries:
                    self.engine.abort(out.request_id)

    def start(self, warm_up: Callable[[], None] | None = None) -> None:
        """Start the loop thread; `warm_up` (compiling, recording CUDA graphs) runs first *in that
        thread* and `start` returns when it is done (raising what it raised). Inductor keeps its
        CUDA-graph trees per thread: graphs recorded in any other thread are never replayed by the
        loop, and a second memory pool would be recorded mid-serving."""
        self._warm_up = warm_up
        self._warmed = threading.Event()
        self._thread.start()
        self._warmed.wait()
        if self.error is not None:
            self._thread.join()
            raise self.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up()
        except BaseException as exc:
            self.error = exc
            return
        finally:
            self._warmed.set()
        try:
            while not self._stop.is_set():
                if not self.engine.step():
                    self.engine.wait_for_work(timeout=0.1)
        except BaseException as exc:  # the loop itself broke: fail everyone, report unhealthy
            log.exception("engine loop died")
            self.error = exc
            self.engine.fail_all(f"engine loop died: {exc}")
            self._flush()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids (a grammar may end only where it is complete)."""
        return self.engine.eos_token_ids

    @property
    def kv_capacity(self) -> KVCapacity:
        return KVCapacity(self.engine.pool.num_blocks, self.engine.pool.block_size)

    def stats(self) -> dict[str, int | float | bool | str]:
        """Counters of the engine since start-up (for GET /v1/engine/stats); a racy but consistent
        enough read from another thread: each value is one int read."""
        return self.engine.stats_snapshot()

    def adapter_names(self) -> dict[str, str]:
        """Served LoRA adapters and their sources."""
        return self.engine.adapter_names()

    async def load_adapter(self, name: str, source: str) -> None:
        """Read, check and serve an adapter (off the event loop: it reads files)."""
        try:
            await asyncio.to_thread(self.engine.load_adapter, name, source)
        except ValueError as exc:  # lora.files.AdapterError, a taken name, LoRA off
            raise AdapterLoadError(str(exc)) from None

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.engine.abort("")  # wakes the loop
        self._thread.join(timeout)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: DecodingParams,
        grammar: Grammar | None = None,
        model: str | None = None,
        source_len: int = 0,
        source_features: torch.Tensor | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit one request and yield its outputs until every choice has finished
        (client.stream_outputs); its rows are constrained by `grammar` when given, and run
        with the LoRA adapter or on the extra model `model` names when given."""
        if not self.alive:
            raise EngineDead("engine is not running")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def emit(out: RequestOutput) -> None:  # the engine thread only; delivered by _flush
            self._outbox.append((loop, (outputs, out)))

        request = EngineRequest(
            request_id,
            prompt_ids,
            params,
            emit,
            trace_id=request_id_var.get(),
            constraint=grammar.new_constraint() if grammar is not None else None,
            source_len=source_len,
            source_features=source_features,
        )
        request.model_name = model
        self.engine.submit(request)
        async for out in stream_outputs(outputs, lambda: self.engine.abort(request_id)):
            yield out
