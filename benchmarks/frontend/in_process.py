"""(a) In process: the server's engine, built from the same flags as `beamline serve` builds it,
stepped in a plain loop under a closed loop of requests submitted directly (no HTTP, no client)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from benchmarks.frontend.cpu import (
    ENGINE,
    WORKERS,
    cpu_split,
    process_cpu_s,
    system_busy_s,
    thread_samples,
)
from benchmarks.frontend.results import Counters, ModeResult, mode_result
from benchmarks.frontend.step_model import Step
from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest
from server.cli import _add_serve_args
from server.config import ServerConfig, load_config
from server.engine.async_engine import AsyncEngine


def server_config(model_dir: Path, server_args: Sequence[str]) -> ServerConfig:
    """The ServerConfig `beamline serve --model DIR <server_args>` would run with (same flags,
    same env vars), so both sides of the comparison build the same engine."""
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    ns = parser.parse_args(["--model", str(model_dir), *server_args])
    overrides = {k: v for k, v in vars(ns).items() if k != "config"}
    return load_config(ns.config, overrides)


class InProcess:
    """The engine exactly as the server builds it (bootstrap.build_serving_context: runner,
    engine with metrics, warm-up, gc.freeze), with its loop thread stopped so that this thread
    steps it: no event loop, no HTTP, no client."""

    def __init__(self, model_dir: Path, server_args: Sequence[str]) -> None:
        from server.bootstrap import build_serving_context

        self.ctx = build_serving_context(server_config(model_dir, server_args))
        assert isinstance(self.ctx.engine, AsyncEngine)  # --engine-process off
        self.ctx.engine.shutdown()
        self.engine = self.ctx.engine.engine
        self.tokenizer = self.ctx.tokenizer
        self._ids = 0
        self.steps: list[list[Step]] = []  # per recorded run, each step

    def counters(self) -> Counters:
        metrics = self.ctx.metrics
        text = metrics.render()[0].decode() if metrics is not None else ""
        return Counters.parse(self.engine.stats_snapshot(), text)

    def run(
        self,
        requests: Sequence[BenchRequest],
        concurrency: int,
        mode: str = "in-process",
        record: bool = True,
    ) -> ModeResult:
        """Closed loop: the next request is submitted from the emit callback of one that ended,
        so C requests are always in the engine (what a client with no latency would do)."""
        from decoding import DecodingParams
        from server.api.tokenization import encode_text
        from server.engine.request import EngineRequest, RequestOutput

        prompts = [encode_text(self.tokenizer, r.prompt, "prompt") for r in requests]  # not timed
        pending = deque(zip(requests, prompts))
        results: list[RequestResult] = []

        def submit_next() -> None:
            req, ids = pending.popleft()
            result = RequestResult(index=req.index, expected_output_tokens=req.max_tokens)

            def emit(out: RequestOutput) -> None:
                if out.request_done:
                    result.output_tokens = out.completion_tokens
                    result.error = out.error or ""
                    result.success = out.error is None and out.finish_reason != "abort"
                    results.append(result)
                    if pending:
                        submit_next()

            self._ids += 1
            params = DecodingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0)
            self.engine.submit(EngineRequest(f"inproc-{self._ids}", ids, params, emit))

        engine = self.engine
        stats = engine.stats
        rows_before = dict(engine.stats.step_seqs_histogram)
        before = self.counters()
        cpu_before, process_before = thread_samples(os.getpid()), process_cpu_s(os.getpid())
        busy_before = system_busy_s()
        step_s: list[float] = []
        recorded: list[Step] = []
        if record:
            self.steps.append(recorded)
        start = time.perf_counter()
        for _ in range(min(concurrency, len(pending))):
            submit_next()
        while len(results) < len(requests):
            computed, generated = stats.tokens_computed, stats.tokens_generated
            t = time.perf_counter()
            if engine.step():
                step_s.append(time.perf_counter() - t)
                computed, generated = (
                    stats.tokens_computed - computed,
                    stats.tokens_generated - generated,
                )
                recorded.append((computed, generated, step_s[-1]))
            elif not engine.scheduler.has_work() and engine.num_waiting == 0:
                raise RuntimeError("the engine ran out of work before every request ended")
        wall = time.perf_counter() - start
        cpu_after, process_after = thread_samples(os.getpid()), process_cpu_s(os.getpid())
        busy = system_busy_s() - busy_before
        after = self.counters()
        out = mode_result(mode, concurrency, results, wall, before, after)
        out.step_ms_mean = statistics.fmean(step_s) * 1e3 if step_s else None
        out.step_ms_median = statistics.median(step_s) * 1e3 if step_s else None
        hist = {
            rows: n - rows_before.get(rows, 0)
            for rows, n in engine.stats.step_seqs_histogram.items()
        }
        steps = sum(hist.values())
        out.rows_per_step_exact = sum(r * n for r, n in hist.items()) / steps if steps else None
        main_tid = threading.get_native_id()

        def classify(tid: int, comm: str) -> tuple[str, str]:
            return (comm, ENGINE) if tid == main_tid else (comm, WORKERS)

        out.server_cpu = cpu_split(
            cpu_before, cpu_after, process_after - process_before, wall, classify
        )
        out.others_cores = max(0.0, busy - (process_after - process_before)) / wall
        return out


@contextlib.contextmanager
def process_state_restored() -> Iterator[None]:
    """Building the engine as the server does sets torch's thread count and freezes the garbage
    collector's objects (bootstrap.py); undo both afterwards, so that a caller (a test session)
    keeps its own settings."""
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if frozen == 0:
            gc.unfreeze()
