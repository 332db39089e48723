"""The front end's EngineClient over an engine process (worker.py), spawned at start-up.

Two threads of the front end's process talk to it: a sender writes requests and aborts (the event
loop never blocks on a full pipe), a reader takes each step's Outputs message, replays its metric
calls, keeps its counters for /v1/engine/stats and hands its outputs to the event loops in one
call per loop. If the engine process dies, every request still open gets an error output and the
client reports itself dead (/health answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator

import torch

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.config import ServerConfig
from server.engine.client import (
    AdapterLoadError,
    EngineDead,
    KVCapacity,
    UnknownAdapter,
    stream_outputs,
)
from server.engine.request import RequestOutput
from server.logs import request_id_var
from server.metrics import Metrics
from server.process.messages import (
    Abort,
    AdapterLoaded,
    Died,
    LoadAdapter,
    Outputs,
    Ready,
    Shutdown,
    StartupFailed,
    Submit,
    UnloadAdapter,
)
from server.process.metrics_relay import replay
from server.process.worker import run_engine_process

log = logging.getLogger(__name__)

Consumer = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput]", int]  # + prompt len
Outgoing = Submit | Abort | LoadAdapter | UnloadAdapter | Shutdown


class EngineStartupError(RuntimeError):
    """The engine process could not load or warm up the model."""


Delivery = tuple["asyncio.Queue[RequestOutput]", RequestOutput]
ByLoop = defaultdict[asyncio.AbstractEventLoop, list[Delivery]]


def _deliver(deliveries: list[Delivery]) -> None:
    """On the event loop: put each output into its request's queue."""
    for outputs, out in deliveries:
        outputs.put_nowait(out)


def _post(by_loop: ByLoop) -> None:
    """Hand each event loop its outputs in one call."""
    for loop, deliveries in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, deliveries)
        except RuntimeError:  # that event loop is gone: nobody reads these
            pass


class EngineProcessClient:
    def __init__(
        self, config: ServerConfig, metrics: Metrics | None = None, name: str = "beamline-engine"
    ) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_process,
            args=(config, child_conn),
            name=name,
            daemon=True,  # never outlives the front end
        )
        self._child_conn = child_conn
        self.metrics = metrics
        self._consumers: dict[str, Consumer] = {}
        self._outgoing: queue.SimpleQueue[Outgoing] = queue.SimpleQueue()
        # LoRA adapters as the engine process serves them, kept here as its answers arrive
        self._adapters: dict[str, str] = {}
        self._adapter_calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self._call_ids = itertools.count()
        self._ready: Ready | None = None
        self._stats: dict[str, int | float | bool | str] = {}
        self.error: str | None = None
        self._closing = False

    def start(self) -> None:
        """Spawn the engine process and wait until it has loaded and warmed up the model."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        self._process.start()
        self._child_conn.close()  # the child's end lives in the child only: EOF when it dies

    def wait_ready(self) -> None:
        """Wait until the spawned process has loaded and warmed up the model (or failed to)."""
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise EngineStartupError(
                f"the engine process exited while loading (exit code {self._process.exitcode})"
            ) from None
        if isinstance(message, StartupFailed):
            self._process.join(5)
            raise EngineStartupError(message.message)
        assert isinstance(message, Ready), message
        self._ready = message
        self._adapters = dict(message.adapters)
        self._stats = message.stats
        replay(message.metric_events, self.metrics)
        threading.Thread(target=self._read, name="beamline-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="beamline-engine-writer", daemon=True).start()

    # ---- what the front end reads --------------------------------------------------------------
    @property
    def ready(self) -> Ready:
        if self._ready is None:
            raise EngineDead("the engine process has not started")
        return self._ready

    @property
    def alive(self) -> bool:
        return self._ready is not None and self.error is None and self._process.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.ready.eos_token_ids

    @property
    def kv_capacity(self) -> KVCapacity:
        return KVCapacity(self.ready.num_blocks, self.ready.block_size)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def stats(self) -> dict[str, int | float | bool | str]:
        """The counters as of the engine's last step that sent anything (they travel with its
        outputs, so never behind what clients were sent)."""
        return dict(self._stats)

    # ---- requests -------------------------------------------------------------------------------
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
        if not self.alive:
            raise EngineDead("engine is not running")
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        prompt_tokens = source_len or len(prompt_ids)  # what a failure's usage counts
        self._consumers[request_id] = (asyncio.get_running_loop(), outputs, prompt_tokens)
        if self.error is not None:  # died since: the reader may have failed the others already
            self._consumers.pop(request_id, None)
            raise EngineDead("engine is not running")
        spec = grammar.spec if grammar is not None else None
        trace_id = request_id_var.get()
        self._outgoing.put(
            Submit(
                request_id,
                prompt_ids,
                params,
                trace_id,
                spec,
                model,
                source_len,
                source_features,
            )
        )

        def abort() -> None:
            if self._consumers.pop(request_id, None) is not None:
                self._outgoing.put(Abort(request_id))

        async for out in stream_outputs(outputs, abort):
            yield out

    # ---- LoRA adapters --------------------------------------------------------------------------
    def adapter_names(self) -> dict[str, str]:
        return dict(self._adapters)

    async def load_adapter(self, name: str, source: str) -> None:
        """Ask the engine process to load an adapter and wait for its answer."""
        if not self.alive:
            raise EngineDead("engine is not running")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[None] = loop.create_future()
        call_id = next(self._call_ids)
        self._adapter_calls[call_id] = (loop, answer)
        self._outgoing.put(LoadAdapter(call_id, name, source))
        try:
            await answer
        finally:
            self._adapter_calls.pop(call_id, None)
        self._adapters[name] = source

    def unload_adapter(self, name: str) -> None:
        """Hide `name` at once; the engine process forgets it after the requests sent before."""
        if self._adapters.pop(name, None) is None:
            raise UnknownAdapter(name)
        self._outgoing.put(UnloadAdapter(name))

    def _answer(self, reply: AdapterLoaded) -> None:
        call = self._adapter_calls.get(reply.call_id)
        if call is None:
            return
        loop, answer = call

        def settle() -> None:
            if answer.done():
                return
            if reply.error is None:
                answer.set_result(None)
            else:
                answer.set_exception(AdapterLoadError(reply.error))

        with contextlib.suppress(RuntimeError):  # that event loop is gone
            loop.call_soon_threadsafe(settle)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        if self._process.is_alive():
            self._outgoing.put(Shutdown())
            self._process.join(timeout)
        if self._process.is_alive():  # it ignores SIGTERM (worker.py)
            self._process.kill()
            self._process.join(timeout)

    # ---- the two threads ---------------------------------------------------------------------
    def _write(self) -> None:
        while True:
            message = self._outgoing.get()
            try:
                self._conn.send(message)
            except OSError:  # the engine process is gone; the reader reports it
                return
            if isinstance(message, Shutdown):
                return

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, Outputs):
                    self._hand_over(message)
                elif isinstance(message, Died):
                    self.error = message.message
        except (EOFError, OSError):
            pass
        if self.error is None:
            self.error = f"the engine process exited (exit code {self._process.exitcode})"
            if not self._closing:
                log.error("%s", self.error)
        self._fail_open_requests(self.error)
        for call_id in list(self._adapter_calls):  # nobody will answer these
            self._answer(AdapterLoaded(call_id, f"engine is not running: {self.error}"))

    def _hand_over(self, message: Outputs) -> None:
        replay(message.metric_events, self.metrics)  # metrics first: never behind the responses
        self._stats = message.stats
        for reply in message.adapter_replies:
            self._answer(reply)
        by_loop: ByLoop = defaultdict(list)
        for out in message.outputs:
            consumer = (
                self._consumers.pop(out.request_id, None)
                if out.request_done
                else self._consumers.get(out.request_id)
            )
            if consumer is not None:  # else aborted: nobody reads it
                by_loop[consumer[0]].append((consumer[1], out))
        _post(by_loop)

    def _fail_open_requests(self, error: str) -> None:
        by_loop: ByLoop = defaultdict(list)
        for request_id in list(self._consumers):
            consumer = self._consumers.pop(request_id, None)
            if consumer is None:
                continue
            loop, outputs, prompt_len = consumer
            end = RequestOutput(
                request_id, 0, "", [], "error", prompt_len, 0, error=error, request_done=True
            )
            by_loop[loop].append((outputs, end))
        _post(by_loop)
