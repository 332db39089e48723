"""The decode step compiled while the server already answers.

At a first start, compiling the decode step takes minutes on a small CPU; at a later one, reading
it from the compile cache takes seconds. Neither has to hold back the first answer: the runner
serves with the eager step (the same function, uncompiled) while

- a process of its own (`python -m server.compile_worker`: niced, inductor on one thread) builds
  the same runner on a tiny KV pool and compiles the step into the compile cache, unless the
  cache holds it already; a process, not a thread, because dynamo's tracing is Python that would
  take the GIL from the engine's thread between every two of its ops. It starts once the runner
  has been quiet a moment too (`wait_until_quiet`): started at once, it slowed a first answer
  from about 0.5 to 2-3 s on a 2-core CPU;
- a thread of this process then reads the graphs from the cache (unpickling, off the engine's
  thread: it touches nothing the steps use), once the runner has run no forward for a moment
  (`ForwardClock`), or half a minute later at the latest: unpickling holds the GIL for seconds at
  a time, and a step of a request in flight would wait for all of it (a later start's first
  answer came after the whole read, 5-7 s, on a 2-core CPU);
- the runner adopts them between two steps, in the thread that steps (`DecodeStepInUse.
  between_steps`, decode_step.py): their guards checked and each graph run once on the pool's
  spare block, which no sequence owns. A request in flight goes on with the compiled step from
  its next token.

Should the compile fail, the server keeps serving eagerly and says why in the log.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from server.model.compiled_decode import ExampleInputs
from server.model.compiled_steps import CompiledSteps

log = logging.getLogger(__name__)
WORKER = "server.compile_worker"  # the module run as the compile process
NOT_AHEAD_OF_TIME = 3  # its exit code when the step compiles only the plain way (nothing saved)
NICENESS = 10  # the compile process's: the server's steps first
NICENESS_VARIABLE = "BEAMLINE_COMPILE_NICENESS"  # how the compile process is told it
QUIET_S = 1.0  # no forward for this long: the compile process starts, or the step is read
AT_THE_LATEST_S = 30.0  # or this long after either could, quiet or not


class ForwardClock:
    """Whether the runner runs a forward now, and since when it has not: what the compile
    process's start and the compiled step's read wait for (`wait_until_quiet`)."""

    def __init__(self) -> None:
        self._running = 0
        self._last_end = time.monotonic()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._last_end = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last forward ended (0 while one runs)."""
        return 0.0 if self._running else time.monotonic() - self._last_end


class BackgroundCompile:
    """One runner's decode step, compiled or loaded beside serving: `start` it once, then ask
    `done` between steps and `adopt` it when it is."""

    def __init__(self, worker_spec: str) -> None:
        self.worker_spec = worker_spec  # the compile process's input (compile_worker.py)
        self.failure: str | None = None  # why no compiled step can be adopted
        self._graphs: list[list[Any]] | None = None
        self._done = threading.Event()
        self.process: subprocess.Popen[str] | None = None

    def start(self, steps: CompiledSteps, quiet_for: Callable[[], float]) -> None:
        """Compile (unless cached) and read the step in a thread; `quiet_for` says for how long
        the runner has run no forward (ForwardClock.quiet_for)."""
        atexit.register(self.stop)  # a server that ends stops its compile too
        name = "beamline-compile"
        args = (steps, quiet_for)
        threading.Thread(target=self._run, args=args, name=name, daemon=True).start()

    @property
    def done(self) -> bool:
        """Whether `adopt` has something to say: graphs to use, or a failure."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or `timeout` seconds): whether it is."""
        return self._done.wait(timeout)

    def adopt(self, steps: CompiledSteps, example: ExampleInputs) -> bool:
        """In the thread that steps, once done: use the graphs from now on (True), or log why
        not and keep the eager step (False)."""
        why = self.failure
        if why is None:
            assert self._graphs is not None
            why = steps.adopt(self._graphs, example)
        if why is not None:
            log.warning("the decode step stays eager: %s", why)
            return False
        log.info("compiled decode step in use from this step on")
        return True

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()

    def _run(self, steps: CompiledSteps, quiet_for: Callable[[], float]) -> None:
        try:
            if not steps.cached:
                wait_until_quiet(quiet_for)  # its start-up takes a core: a first answer first
                self._compile_elsewhere()
            if self.failure is None:
                wait_until_quiet(quiet_for)
                started = time.monotonic()
                # in the grad mode steps run in: the guards built here record it
                with torch.inference_mode():
                    self._graphs = steps.read_cached()
                if self._graphs is None:
                    self.failure = f"no compiled step could be read from {steps.base.directory}"
                else:
                    took = time.monotonic() - started
                    log.info("compiled decode step read from the cache in %.1f s", took)
        except Exception as error:  # anything: the server serves on, eagerly
            self.failure = f"{type(error).__name__}: {error}"
        finally:
            self._done.set()

    def _compile_elsewhere(self) -> None:
        log.info(
            "compiling the decode step in a background process (about 1.5 min on 2 CPU cores, "
            "later starts load it); serving with the eager step meanwhile"
        )
        started = time.monotonic()
        env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", NICENESS_VARIABLE: str(NICENESS)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER], stdin=subprocess.PIPE, text=True, env=env
        )
        self.process.communicate(self.worker_spec)
        code = self.process.returncode
        if code == NOT_AHEAD_OF_TIME:
            self.failure = (
                "the decoder does not compile ahead of time as one graph (the compile process's "
                "log says why); --no-compile-while-serving compiles it the plain way instead"
            )
            return
        if code < 0:  # a signal: the server stopping (its unit or group signalled), or a kill
            self.failure = f"the compile process was stopped by signal {-code}"
            return
        if code != 0:
            self.failure = f"the compile process ended with exit code {code} (its log is above)"
            return
        took = time.monotonic() - started
        log.info("decode step compiled by a background process in %.0f s", took)


def wait_until_quiet(quiet_for: Callable[[], float], poll_s: float = 0.05) -> None:
    """Until the runner has run no forward for QUIET_S since this call, or for
    AT_THE_LATEST_S: a start reads the step a second after it is ready at the soonest, so
    that a client waiting for /health to say so gets its answer first."""
    started = time.monotonic()
    deadline = started + AT_THE_LATEST_S
    while (now := time.monotonic()) < deadline:
        if min(quiet_for(), now - started) >= QUIET_S:
            return
        time.sleep(poll_s)
