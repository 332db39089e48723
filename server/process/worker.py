"""The engine process: loads the engine, then steps it in its main thread while a receiver thread
takes requests and aborts off the pipe. Each step's outputs leave in one message (messages.Outputs)
sent by the engine thread as the step ends, as AsyncEngine hands them to the event loop in one
call. The process ends when the front end says so or its end of the pipe closes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import cast

from tqdm import tqdm

from decoding.grammar import Grammar, GrammarCompiler, GrammarSpec
from server.config import ServerConfig
from server.engine.client import UnknownAdapter
from server.engine.engine import Engine
from server.engine.request import EngineRequest, RequestOutput
from server.grammars import build_compiler
from server.loading import freeze_start_up_objects, load_engine
from server.logs import setup_logging
from server.metrics import Metrics
from server.model.loader import default_cache_dir
from server.process.messages import (
    Abort,
    AdapterLoaded,
    Died,
    LoadAdapter,
    Outputs,
    Ready,
    StartupFailed,
    Submit,
    UnloadAdapter,
)
from server.process.metrics_relay import MetricsRelay
from server.tokenizer_cache import token_bytes_path

log = logging.getLogger(__name__)


class GrammarCache:
    """Compiled grammars by spec. The front end compiled (and so validated) each spec already;
    the engine process compiles it again because llguidance's matchers cannot be pickled. The
    tokenizer view llguidance needs is built in the background from start-up on."""

    def __init__(self, compiler: Future[GrammarCompiler], size: int) -> None:
        self._compiler = compiler
        self._size = max(size, 1)
        self._grammars: OrderedDict[GrammarSpec, Grammar] = OrderedDict()

    def get(self, spec: GrammarSpec) -> Grammar:
        grammar = self._grammars.get(spec)
        if grammar is None:
            grammar = self._grammars[spec] = self._compiler.result().compile(spec)
            while len(self._grammars) > self._size:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(spec)
        return grammar


class EngineLoop:
    def __init__(
        self, engine: Engine, conn: Connection, relay: MetricsRelay, grammars: GrammarCache
    ) -> None:
        self.engine = engine
        self.conn = conn
        self.relay = relay
        self.grammars = grammars
        self.stop = threading.Event()
        self.outbox: list[RequestOutput] = []  # the engine thread's outputs
        self.refused: deque[RequestOutput] = deque()  # the receiver's, for the engine thread
        self.adapter_replies: deque[AdapterLoaded] = deque()  # the loader's, for the same
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="beamline-lora")
        engine.flush_outputs = self.flush

    def emit(self, out: RequestOutput) -> None:
        """The engine thread: an output for the step's message (flush sends it)."""
        self.outbox.append(out)

    def flush(self) -> None:
        """The engine thread, after each step: everything the step produced, in one message."""
        while self.refused:
            self.outbox.append(self.refused.popleft())
        replies = []
        while self.adapter_replies:
            replies.append(self.adapter_replies.popleft())
        events = self.relay.drain()
        if not self.outbox and not events and not replies:
            return
        outputs, self.outbox = self.outbox, []
        self.conn.send(Outputs(outputs, events, self.engine.stats_snapshot(), replies))

    def load_adapter(self, message: LoadAdapter) -> None:
        """A loader thread: read and check the adapter; the engine thread's next flush answers."""
        try:
            self.engine.load_adapter(message.name, message.source)
            error = None
        except ValueError as exc:  # lora.files.AdapterError, a taken name, LoRA off
            error = str(exc)
        except Exception as exc:  # never leave the front end waiting
            log.exception("loading LoRA adapter %s failed", message.name)
            error = f"{type(exc).__name__}: {exc}"
        self.adapter_replies.append(AdapterLoaded(message.call_id, error))
        self.engine.abort("")  # wakes the loop, whose next flush sends it

    def receive(self) -> None:
        """The receiver thread: requests and aborts until Shutdown or the front end is gone."""
        try:
            while True:
                message = self.conn.recv()
                if isinstance(message, Submit):
                    self.submit(message)
                elif isinstance(message, Abort):
                    self.engine.abort(message.request_id)
                elif isinstance(message, LoadAdapter):
                    self.loader.submit(self.load_adapter, message)
                elif isinstance(message, UnloadAdapter):
                    with contextlib.suppress(UnknownAdapter):  # the front end checked
                        self.engine.unload_adapter(message.name)
                else:
                    break
        except (EOFError, OSError):
            pass
        self.stop.set()
        self.engine.abort("")  # wakes the loop

    def submit(self, message: Submit) -> None:
        request = EngineRequest(
            message.request_id,
            message.prompt_ids,
            message.params,
            self.emit,
            trace_id=message.trace_id,
            source_len=message.source_len,
            source_features=message.source_features,
        )
        request.model_name = message.model
        if message.grammar is not None:
            try:
                request.constraint = self.grammars.get(message.grammar).new_constraint()
            except Exception as exc:  # validated by the front end: should not happen
                log.exception("grammar failed to compile in the engine process")
                self.refused.append(_failed(message, f"grammar failed to compile: {exc}"))
                self.engine.abort("")  # wakes the loop, whose next flush sends it
                return
        self.engine.submit(request)

    def run(self) -> None:
        threading.Thread(target=self.receive, name="beamline-receiver", daemon=True).start()
        try:
            while not self.stop.is_set():
                if not self.engine.step():
                    self.engine.wait_for_work(timeout=0.1)
        except BaseException as exc:  # the loop broke: fail everyone, tell the front end
            log.exception("engine loop died")
            self.engine.fail_all(f"engine loop died: {exc}")
            self.flush()
            self.conn.send(Died(f"engine loop died: {exc}"))


def _failed(message: Submit, error: str) -> RequestOutput:
    return RequestOutput(
        message.request_id,
        0,
        "",
        [],
        "error",
        len(message.prompt_ids),
        0,
        error=error,
        request_done=True,
    )


def run_engine_process(config: ServerConfig, conn: Connection) -> None:
    """The process's target (spawned): load, warm up, say Ready (or why not), serve.

    Termination signals are the front end's to handle: Ctrl-C reaches the whole process group and
    systemd signals every process of the unit, but in-flight requests must drain first. This
    process ends when the front end says so, or when the pipe closes because the front end is
    gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The loading bars' lock: tqdm's default is a multiprocessing semaphore, which this process,
    # ending without interpreter teardown, would leave to the resource tracker's leak warning.
    tqdm.set_lock(threading.RLock())
    setup_logging(config.log_level, config.log_format)
    try:
        loaded = load_engine(config)
        engine = loaded.engine
        relay = MetricsRelay()
        engine.use_metrics(cast(Metrics, relay))
        loaded.warm_up()  # compiled and recorded in the thread that steps
        compiler = ThreadPoolExecutor(1, thread_name_prefix="beamline-grammar").submit(
            build_compiler,
            loaded.tokenizer,
            loaded.runner.vocab_size,
            engine.eos_token_ids,
            token_bytes_path(loaded.model_dir, config.cache_dir or default_cache_dir()),
        )
    except BaseException as exc:  # the front end logs the reason, on one line, and exits 1
        log.debug("engine process failed to start", exc_info=True)
        conn.send(StartupFailed(f"{type(exc).__name__}: {exc}"))
        return
    freeze_start_up_objects()
    conn.send(
        Ready(
            adapters=engine.adapter_names(),
            max_model_len=engine.max_model_len,
            eos_token_ids=engine.eos_token_ids,
            num_blocks=engine.pool.num_blocks,
            block_size=engine.pool.block_size,
            vocab_size=loaded.runner.vocab_size,
            stats=engine.stats_snapshot(),
            metric_events=relay.drain(),
        )
    )
    grammars = GrammarCache(compiler, loaded.config.grammar_cache_size)
    EngineLoop(engine, conn, relay, grammars).run()
    loaded.close()  # the other tensor-parallel ranks, if any, stop after the last step
    logging.shutdown()
    os._exit(0)  # no interpreter teardown: daemon threads and native extensions' leak reports
