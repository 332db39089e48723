"""What the HTTP front end costs the engine: its steps per second over HTTP against in process.

The front end (uvicorn, FastAPI, SSE framing) runs in the engine's process, shares its GIL and,
on a small machine, its cores with the load generator too. Tokens per second seen by a client mix
all of that up, so this counts the engine's own steps instead:

(a) in process: the server's engine, built by server/bootstrap.py from the same flags, stepped in
    a plain loop; a closed loop of C requests is submitted directly (no HTTP, no client);
(b) over HTTP: `beamline serve` in a subprocess under the same closed loop, streaming and not;
    the engine's counters come from GET /v1/engine/stats and GET /metrics around the run;
(c) CPU time (user + sys) of the client process and, per thread, of the server process
    (/proc/<pid>/task/*), so the event loop, the engine thread and torch's workers are apart.

The reference is the engine alone doing the same steps: step times measured in process (runs at
C, C/2 and C/4, see StepModel) turn an HTTP run's engine counters (steps, tokens computed, tokens
generated, the tokens-per-step histogram) into the seconds the engine alone would need for
them. Then

    front-end share = 1 - engine-alone seconds / HTTP wall seconds
                    = 1 - HTTP steps/s / in-process steps/s for the same steps,

the fraction of the engine's steps that serving over HTTP takes away at the same batch shape
(GIL and cores taken by the event loop and the client, idle gaps). In-process runs get the same
figure, which is then only the fit's error (about 0). The narrower batches seen over HTTP are a
separate loss, the rows ratio (engine-alone tok/s on the HTTP batch shape / in-process tok/s at
C), so that  HTTP tok/s = in-process tok/s at C x rows ratio x (1 - front-end share).

Torch's intra-op threads: both sides keep torch's default (one per core) unless the server flags
say otherwise. On 2 cores shared with a client an OpenMP team of 2 is oversubscribed: a step
waits whenever one of its threads is off its core (the engine thread's "runq" column), and steps
of the tiny model went from ~2 ms to 200-500 ms while other processes ran. Run once more with
`--server-args "--num-threads 1"` to see the front end's own cost without that effect. The
"others" column (CPU of every other process of the machine during the run) says whether a run
was disturbed: on a shared machine keep only runs where it is about 0.

    python -m benchmarks.frontend_cost            # 512 requests x 64 tokens, c = 256
    python -m benchmarks.frontend_cost --requests 64 --max-tokens 16 --concurrency 16 --out /tmp/fc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import torch

from benchmarks.client import CompletionTarget, make_client, stream_completion
from benchmarks.launch import REPO_ROOT, LaunchError, free_port, stop, wait_healthy
from benchmarks.random_models import SHAPES, build_random_model, word_of
from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest
from server.cli import _add_serve_args
from server.config import ServerConfig, load_config
from server.engine.async_engine import AsyncEngine

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"
ENGINE_THREAD = "beamline-engine"  # server/engine/async_engine.py names its loop thread so
THRESHOLD = 0.20  # the issue's bar: above it, the engine gets its own process
CLK_TCK = os.sysconf("SC_CLK_TCK")
FIRST_WORD_ID = 4 + 256  # random_models.word_tokenizer: 4 specials, 256 bytes, then words

# Thread groups of the CPU split.
EVENT_LOOP = "event loop (main thread)"
ENGINE = "engine thread"
WORKERS = "torch workers (native threads of the engine thread)"
OTHER = "other threads"
# What the server does not expose, and what is derived instead (see the module docstring).
MISSING_COUNTERS = [
    "no counter of the time spent inside engine steps (e.g. a step-seconds sum beside `steps`): "
    "over HTTP, ms per step is wall time / steps (idle gaps included) and the engine-alone time "
    "is modelled from timed in-process steps (StepModel); with that counter the share would be "
    "measured in the server itself",
    "the rows-per-step histogram (EngineStats.step_seqs_histogram) is not in /v1/engine/stats: "
    "rows per step over HTTP = tokens generated / steps (exact for decode-only steps); the "
    "tokens-per-step histogram of /metrics (beamline:iteration_tokens, powers of 2) gives the "
    "shape",
    "no GIL wait counter: the engine thread's off-CPU time (wall - on CPU - run-queue wait, from "
    "/proc/<pid>/task/<tid>/schedstat) bounds it from above (it also holds idle waits for work)",
]


# ---- workload ------------------------------------------------------------------------------------
def vocab_workload(
    num_requests: int,
    max_tokens: int,
    prompt_words: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    salt: str = "",
) -> list[BenchRequest]:
    """Prompts of words of the random model's own vocabulary (one token each): English words
    would all encode as <unk>, and prompts of <unk> share their prefixes in the prefix cache.
    Lengths depend on `seed` only, words on `salt` too, so every mode runs the same amount of
    work without hitting the cache blocks a previous mode left behind."""
    lengths = random.Random(seed)
    words = random.Random(f"{seed}-{salt}")
    requests = []
    for i in range(num_requests):
        n = lengths.randint(*prompt_words)
        ids = [words.randrange(FIRST_WORD_ID, vocab_size) for _ in range(n)]
        requests.append(BenchRequest(i, " ".join(word_of(t) for t in ids), max_tokens))
    return requests


# ---- CPU time per process and per thread (Linux /proc) -------------------------------------------
@dataclass(frozen=True)
class ThreadSample:
    """Cumulative times of one thread: CPU (user + sys, clock ticks), and from schedstat the time
    on a CPU and the time runnable but waiting for one (ns), when the kernel has them."""

    comm: str
    cpu_s: float
    run_s: float | None
    runqueue_s: float | None


def _stat_cpu_s(stat: str) -> float:
    """utime + stime of a /proc stat line (fields 14 and 15; comm may hold spaces)."""
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a whole process (every thread, exited ones included)."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())


def system_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat, all processes):
    minus our processes' own, what other processes took during a run (noise, on a shared box)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK  # guest time is already in user


def thread_samples(pid: int) -> dict[int, ThreadSample]:
    samples: dict[int, ThreadSample] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            cpu = _stat_cpu_s((task / "stat").read_text())
            run: float | None = None
            wait: float | None = None
            with contextlib.suppress(OSError, ValueError):
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                run, wait = int(run_ns) / 1e9, int(wait_ns) / 1e9
        except OSError:  # the thread exited while we read it
            continue
        samples[int(task.name)] = ThreadSample(comm, cpu, run, wait)
    return samples


@dataclass
class ThreadCPU:
    tid: int
    name: str
    group: str
    cpu_s: float
    run_s: float | None
    runqueue_s: float | None


def engine_processes(pid: int) -> list[int]:
    """The server's engine process (`--engine-process on`, server/process/) if it has one: a
    spawned child, told apart from multiprocessing's resource tracker by its command line."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(int(child))
    return found


def server_threads(pids: Sequence[int]) -> tuple[dict[int, ThreadSample], float]:
    """Every thread of the server's processes, and their CPU seconds in all."""
    samples: dict[int, ThreadSample] = {}
    for pid in pids:
        samples.update(thread_samples(pid))
    return samples, sum(process_cpu_s(pid) for pid in pids)


def cpu_split(
    before: dict[int, ThreadSample],
    after: dict[int, ThreadSample],
    process_cpu: float,
    wall_s: float,
    classify: Callable[[int, str], tuple[str, str]],
) -> dict[str, Any]:
    """Per-thread and per-group CPU of one run window, and where the engine thread's wall time
    went: on a CPU, waiting for a CPU (other processes, the client), or off CPU (GIL, idle)."""
    threads = []
    for tid, a in after.items():
        b = before.get(tid)
        name, group = classify(tid, a.comm)

        def delta(x: float | None, y: float | None) -> float | None:
            return None if x is None else x - (y or 0.0)

        threads.append(
            ThreadCPU(
                tid,
                name,
                group,
                a.cpu_s - (b.cpu_s if b else 0.0),
                delta(a.run_s, b.run_s if b else None),
                delta(a.runqueue_s, b.runqueue_s if b else None),
            )
        )
    groups: dict[str, float] = {g: 0.0 for g in (EVENT_LOOP, ENGINE, WORKERS, OTHER)}
    for t in threads:
        groups[t.group] += t.cpu_s
    engine = [t for t in threads if t.group == ENGINE]
    engine_time: dict[str, float] | None = None
    if engine and wall_s > 0:
        e = engine[0]
        on = e.run_s if e.run_s is not None else e.cpu_s
        queued = e.runqueue_s or 0.0
        engine_time = {
            "on_cpu": on / wall_s,
            "runqueue": queued / wall_s,
            "off_cpu": max(0.0, wall_s - on - queued) / wall_s,
        }
    busy = [t for t in threads if t.cpu_s > 0 or (t.run_s or 0) > 1e-3]
    return {
        "wall_s": wall_s,
        "process_cpu_s": process_cpu,
        "process_cores": process_cpu / wall_s if wall_s else 0.0,
        "groups_cpu_s": groups,
        "engine_thread_time": engine_time,
        "threads": [asdict(t) for t in sorted(busy, key=lambda t: -t.cpu_s)],
    }


# ---- the engine's counters -----------------------------------------------------------------------
@dataclass(frozen=True)
class Counters:
    """Engine counters since start-up (/v1/engine/stats) and the cumulative buckets of the
    tokens-per-step histogram (/metrics), read before and after a run."""

    steps: int
    tokens_generated: int
    tokens_computed: int
    max_seqs_in_step: int
    iteration_tokens: dict[float, float]  # upper bound -> cumulative count
    busy_seconds: float = 0.0  # wall time inside engine steps that did work

    @classmethod
    def parse(cls, stats: dict[str, Any], metrics_text: str) -> Counters:
        from prometheus_client.parser import text_string_to_metric_families

        buckets: dict[float, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            if family.name.endswith("iteration_tokens"):
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        buckets[float(s.labels["le"])] = s.value
        return cls(
            int(stats["steps"]),
            int(stats["tokens_generated"]),
            int(stats["tokens_computed"]),
            int(stats["max_seqs_in_step"]),
            buckets,
            float(stats.get("busy_seconds", 0.0)),
        )


def tokens_per_step_histogram(before: Counters, after: Counters) -> dict[str, int]:
    """Steps of the run by tokens in the step, "lo-hi" (both included) -> steps; not cumulative,
    empty buckets left out."""
    out: dict[str, int] = {}
    previous, lower = 0.0, 0.0
    for le in sorted(after.iteration_tokens):
        cumulative = after.iteration_tokens[le] - before.iteration_tokens.get(le, 0.0)
        if cumulative - previous > 0:
            lo, hi = f"{int(lower) + 1}", "inf" if le == float("inf") else f"{int(le)}"
            out[lo if lo == hi else f"{lo}-{hi}"] = int(cumulative - previous)
        previous, lower = cumulative, le
    return out


def _bucket_bounds(label: str) -> tuple[float, float]:
    lo, _, hi = label.partition("-")
    return float(lo), float(hi or lo)


# ---- one run's result ----------------------------------------------------------------------------
@dataclass
class ModeResult:
    mode: str  # in-process | http-stream | http-nonstream
    concurrency: int
    requests: int
    ok: int
    output_tokens: int  # as the client (or the emit callback) counted them
    wall_s: float
    out_tok_s: float
    steps: int
    steps_per_s: float
    rows_per_step: float  # tokens generated / steps
    tokens_generated: int
    ms_per_step: float  # wall / steps
    # share of the run's wall time the engine spent inside its steps (/v1/engine/stats
    # busy_seconds): the rest it waited for work; a step's time includes its waits for the GIL
    in_steps: float | None = None
    step_ms_mean: float | None = None  # timed steps (in process only)
    step_ms_median: float | None = None
    rows_per_step_exact: float | None = None  # from the rows histogram (in process only)
    tokens_computed: int = 0
    max_rows_since_start: int = 0
    tokens_per_step: dict[str, int] = field(default_factory=dict)
    # over HTTP: mean requests in the engine and admitted by the front end, from GET
    # /v1/engine/stats every --poll-s; the event loop answers it, so its busiest moments (a wave
    # of requests ending and starting) are under-sampled
    in_engine_mean: float | None = None
    in_flight_mean: float | None = None
    errors: list[str] = field(default_factory=list)
    server_cpu: dict[str, Any] = field(default_factory=dict)  # in process: this process
    client_cpu_s: float | None = None
    client_cores: float | None = None
    others_cores: float | None = None  # other processes of the machine during the run
    # filled in by compare(): the engine alone on the same steps (StepModel)
    engine_alone_s: float | None = None
    engine_alone_ms_per_step: float | None = None
    frontend_share: float | None = None
    # the same from CPU seconds, which other processes on the machine hardly change: against the
    # engine thread's own (low) and against the engine thread's plus the event loop's (high)
    cpu_share_low: float | None = None
    cpu_share_high: float | None = None
    rows_ratio: float | None = None

    @property
    def label(self) -> str:
        return f"{self.mode} c={self.concurrency}"


def _finish(
    mode: str,
    concurrency: int,
    results: Sequence[RequestResult],
    wall_s: float,
    before: Counters,
    after: Counters,
) -> ModeResult:
    steps = after.steps - before.steps
    generated = after.tokens_generated - before.tokens_generated
    out_tokens = sum(r.output_tokens for r in results if r.success)
    errors = sorted({r.error for r in results if not r.success})[:5]
    return ModeResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(results),
        ok=sum(r.success for r in results),
        output_tokens=out_tokens,
        wall_s=wall_s,
        out_tok_s=out_tokens / wall_s if wall_s else 0.0,
        steps=steps,
        steps_per_s=steps / wall_s if wall_s else 0.0,
        rows_per_step=generated / steps if steps else 0.0,
        tokens_generated=generated,
        ms_per_step=wall_s / steps * 1e3 if steps else 0.0,
        in_steps=(after.busy_seconds - before.busy_seconds) / wall_s if wall_s else None,
        tokens_computed=after.tokens_computed - before.tokens_computed,
        max_rows_since_start=after.max_seqs_in_step,
        tokens_per_step=tokens_per_step_histogram(before, after),
        errors=errors,
    )


# ---- (a) in process ------------------------------------------------------------------------------
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
        out = _finish(mode, concurrency, results, wall, before, after)
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


# ---- (b) over HTTP -------------------------------------------------------------------------------
def _serve_with_thread_names(names_path: str, server_argv: list[str]) -> int:
    """Run `beamline serve` with each Python thread's name given to its OS thread (comm) and
    written with its tid to `names_path`, so /proc tells the event loop, the engine thread and
    the native threads each of them started (they inherit their creator's comm) apart. Python
    3.11 does not name OS threads itself."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_name = 15

    def name_this_thread(name: str) -> None:
        libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        with open(names_path, "a", encoding="utf-8") as f:
            f.write(f"{threading.get_native_id()}\t{name}\n")

    def first_call(frame: FrameType, event: str, arg: object) -> None:
        sys.setprofile(None)  # once per thread: the hook costs nothing after this
        name_this_thread(threading.current_thread().name)

    threading.setprofile(first_call)  # type: ignore[arg-type]
    name_this_thread(threading.current_thread().name)
    from server.cli import main

    return main(["serve", *server_argv])


@contextlib.contextmanager
def launched_server(
    model_dir: Path, server_args: Sequence[str], log_path: Path, timeout_s: float = 300.0
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`beamline serve` on a free loopback port (as benchmarks/launch.py starts it), through the
    thread-naming wrapper above; yields (base_url, process, file of thread names)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    names = log_path.with_suffix(".threads")
    names.unlink(missing_ok=True)
    server_argv = ["--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir)]
    cmd = [sys.executable, "-m", "benchmarks.frontend_cost", "_serve", str(names), *server_argv]
    cmd += list(server_args)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"launching: {shlex.join(cmd)}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        try:
            wait_healthy(base_url, timeout_s, proc)
            yield base_url, proc, names
        finally:
            stop(proc)


def server_classifier(
    pid: int, names_path: Path, engine_pids: Sequence[int] = ()
) -> Callable[[int, str], tuple[str, str]]:
    """Names and groups the server's threads from the wrapper's tid -> Python name file; an
    engine process's main thread is the engine thread, its others count as its workers."""
    engine_process_tids: set[int] = set()
    for child in engine_pids:
        with contextlib.suppress(OSError):
            engine_process_tids.update(thread_samples(child))
    python: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for line in names_path.read_text(encoding="utf-8").splitlines():
            tid, _, name = line.partition("\t")
            python[int(tid)] = name
    engine_names = {n for n in python.values() if n == ENGINE_THREAD} or {
        n
        for n in python.values()
        if "engine" in n and not engine_pids  # not its reader/writer
    }
    engine_comms = {n[:15] for n in engine_names}

    def classify(tid: int, comm: str) -> tuple[str, str]:
        if tid in engine_pids:
            return "engine process", ENGINE
        if tid in engine_process_tids:
            return f"{comm} (engine process)", WORKERS
        if tid == pid:
            return python.get(tid, comm), EVENT_LOOP
        if tid in python:
            return python[tid], ENGINE if python[tid] in engine_names else OTHER
        if comm in engine_comms:
            return f"{comm} (native)", WORKERS
        return f"{comm} (native)", OTHER

    return classify


async def complete_unstreamed(
    client: httpx.AsyncClient, target: CompletionTarget, req: BenchRequest
) -> RequestResult:
    """One non-streaming completion; never raises (failures become `success=False`)."""
    result = RequestResult(index=req.index, expected_output_tokens=req.max_tokens)
    body = target.body(req)
    body["stream"] = False
    body.pop("stream_options", None)
    start = time.perf_counter()
    try:
        resp = await client.post(target.base_url.rstrip("/") + "/v1/completions", json=body)
        payload = resp.json()
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {str(payload)[:200]}"
        else:
            usage = payload.get("usage") or {}
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2el = result.ttft = time.perf_counter() - start
    result.success = not result.error
    return result


Send = Callable[[httpx.AsyncClient, CompletionTarget, BenchRequest], Awaitable[RequestResult]]


async def closed_loop(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    requests: Sequence[BenchRequest],
    concurrency: int,
    send: Send,
) -> list[RequestResult]:
    """`concurrency` workers, each sending the next request when its last one ended (as
    benchmarks/client.run_concurrency, without its progress bar: the client's CPU counts)."""
    queue = deque(requests)
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            results.append(await send(client, target, queue.popleft()))

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return results


async def _get_counters(client: httpx.AsyncClient, base_url: str) -> Counters:
    stats = (await client.get(base_url + "/v1/engine/stats")).json()
    metrics = (await client.get(base_url + "/metrics")).text
    return Counters.parse(stats, metrics)


async def _poll(
    client: httpx.AsyncClient, base_url: str, every_s: float, out: list[tuple[int, int]]
) -> None:
    """Samples (requests in the engine, requests admitted by the front end) until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            s = (await client.get(base_url + "/v1/engine/stats")).json()
            engine = int(s["num_requests_running"]) + int(s["num_requests_waiting"])
            out.append((engine, int(s.get("num_requests_in_flight", engine))))


async def http_run(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    stream: bool,
    server_pid: int,
    names_path: Path,
    poll_s: float = 0.25,
    timeout_s: float = 600.0,
) -> ModeResult:
    """The closed loop against the server, with the engine's counters and the CPU of the server
    (and its engine process, when it has one) and the client read right before the first request
    and right after the last response."""
    target = CompletionTarget(base_url, model, request_timeout_s=timeout_s)
    send: Send = stream_completion if stream else complete_unstreamed
    samples: list[tuple[int, int]] = []
    async with make_client(concurrency + 2, timeout_s) as client:
        before = await _get_counters(client, base_url)
        children = engine_processes(server_pid)
        pids = [server_pid, *children]
        srv_before, srv_proc_before = server_threads(pids)
        client_before, busy_before = process_cpu_s(os.getpid()), system_busy_s()
        start = time.perf_counter()
        poller = asyncio.create_task(_poll(client, base_url, poll_s, samples))
        results = await closed_loop(client, target, requests, concurrency, send)
        wall = time.perf_counter() - start
        srv_after, srv_proc_after = server_threads(pids)
        client_after, busy = process_cpu_s(os.getpid()), system_busy_s() - busy_before
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        after = await _get_counters(client, base_url)
    mode = ("http-stream" if stream else "http-nonstream") + ("+process" if children else "")
    out = _finish(mode, concurrency, results, wall, before, after)
    classify = server_classifier(server_pid, names_path, children)  # every thread has started
    out.server_cpu = cpu_split(
        srv_before, srv_after, srv_proc_after - srv_proc_before, wall, classify
    )
    out.client_cpu_s = client_after - client_before
    out.client_cores = out.client_cpu_s / wall if wall else 0.0
    own = srv_proc_after - srv_proc_before + out.client_cpu_s
    out.others_cores = max(0.0, busy - own) / wall if wall else 0.0
    if samples:
        out.in_engine_mean = statistics.fmean(s[0] for s in samples)
        out.in_flight_mean = statistics.fmean(s[1] for s in samples)
    return out


# ---- comparison and report -----------------------------------------------------------------------
Step = tuple[int, int, float]  # one in-process step: tokens computed, rows sampled, seconds


@dataclass(frozen=True)
class StepModel:
    """Seconds the engine alone needs for a run's steps, from the in-process runs:

        sum over the run's steps of f(rows) + b x (tokens computed - rows sampled)

    f, a decode step's time by width, goes through one anchor per in-process run (mean rows and
    mean time of its decode-only steps), linear between anchors and beyond them; b is the median
    extra time per prefill token of the steps that also prefilled. Anchors, not one straight
    line: a step is not linear in its rows (tiny model, one thread: 84 us per row at 64 rows,
    72 at 128, 105 at 256). The HTTP counters give totals and a tokens-per-step histogram, not
    each step's rows: `seconds` spreads the rows over the histogram's buckets."""

    anchors: list[tuple[float, float]]  # (rows, seconds of a decode step), by rows
    prefill_token_s: float
    num_steps: int

    @classmethod
    def fit(cls, runs: Sequence[Sequence[Step]]) -> StepModel:
        anchors = []
        for steps in runs:
            decode = [(rows, sec) for tokens, rows, sec in steps if tokens == rows and rows]
            if decode:
                anchors.append(
                    (statistics.fmean(r for r, _ in decode), statistics.fmean(t for _, t in decode))
                )
        model = cls(sorted(anchors), 0.0, sum(len(steps) for steps in runs))
        extra = [
            (sec - model.decode_s(rows)) / (tokens - rows)
            for steps in runs
            for tokens, rows, sec in steps
            if tokens > rows
        ]
        return cls(model.anchors, statistics.median(extra) if extra else 0.0, model.num_steps)

    def decode_s(self, rows: float) -> float:
        """f(rows): linear through the anchors (the nearest segment beyond them)."""
        a = self.anchors
        if not a:
            return 0.0
        if len(a) == 1:
            return a[0][1] * rows / a[0][0]
        i = 1
        while i < len(a) - 1 and rows > a[i][0]:
            i += 1
        (r0, t0), (r1, t1) = a[i - 1], a[i]
        return max(0.0, t0 + (t1 - t0) * (rows - r0) / (r1 - r0) if r1 != r0 else t0)

    def seconds(
        self,
        steps: int,
        tokens: int,
        rows: int,
        histogram: dict[str, int] | None = None,
        max_rows: int | None = None,
    ) -> float:
        """Engine-alone seconds of `steps` steps that computed `tokens` tokens and sampled `rows`
        rows. With the run's tokens-per-step histogram, f is summed over the buckets rather than
        taken at the mean width (f is far from straight: a run of many near-empty and many full
        steps is not one of half-full steps); each bucket's steps sit at the same relative place
        in it, lo + x (hi - lo) rows (at most `max_rows`), x such that the rows add up."""
        if not steps:
            return 0.0
        prefill = self.prefill_token_s * max(0, tokens - rows)
        buckets = [(n, *_bucket_bounds(k)) for k, n in (histogram or {}).items()]
        if not buckets or any(hi == float("inf") for _, _, hi in buckets):
            return steps * self.decode_s(rows / steps) + prefill
        cap = float(max_rows or max(hi for *_, hi in buckets))

        def widths(x: float) -> list[tuple[int, float]]:
            return [(n, min(cap, lo + x * (hi - lo))) for n, lo, hi in buckets]

        lo_x, hi_x = 0.0, 1.0
        for _ in range(40):  # bisection: total rows grow with x
            mid = (lo_x + hi_x) / 2
            if sum(n * w for n, w in widths(mid)) < rows:
                lo_x = mid
            else:
                hi_x = mid
        return sum(n * self.decode_s(w) for n, w in widths((lo_x + hi_x) / 2)) + prefill

    def describe(self) -> str:
        points = ", ".join(f"{r:.0f} rows {t * 1e3:.2f} ms" for r, t in self.anchors)
        return (
            f"engine alone ({self.num_steps} in-process steps): decode step {points}; "
            f"+{self.prefill_token_s * 1e6:.1f} us per prefill token"
        )


def compare(run: ModeResult, model: StepModel, at_concurrency: ModeResult, max_rows: int) -> None:
    """Front-end share of `run` against the engine alone on the same steps; rows ratio: what its
    batch shape alone costs, against the in-process run at full concurrency.

    The wall-time share counts every wait of the engine thread, for a core too, so other
    processes on a shared machine inflate it. The CPU bounds do not wait: the engine thread's
    own CPU seconds over HTTP (hand-offs to the event loop, GIL switches) give a low bound, and
    adding the event loop's (as if the GIL serialised all of it with the engine) a high one."""
    alone = model.seconds(
        run.steps, run.tokens_computed, run.tokens_generated, run.tokens_per_step, max_rows
    )
    run.engine_alone_s = alone
    if run.steps:
        run.engine_alone_ms_per_step = alone / run.steps * 1e3
    if run.wall_s > 0:
        run.frontend_share = 1.0 - alone / run.wall_s
    if alone > 0 and at_concurrency.out_tok_s > 0:
        run.rows_ratio = run.tokens_generated / alone / at_concurrency.out_tok_s
    groups = run.server_cpu.get("groups_cpu_s") or {}
    engine, loop = groups.get(ENGINE, 0.0), groups.get(EVENT_LOOP, 0.0)
    if engine > 0:
        run.cpu_share_low = 1.0 - alone / engine
        run.cpu_share_high = 1.0 - alone / (engine + loop)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(modes: Sequence[ModeResult]) -> str:
    head = (
        f"{'mode':<24} {'out tok/s':>9} {'steps/s':>8} {'rows/step':>9} {'ms/step':>8} "
        f"{'timed ms':>8} {'alone ms':>8} {'FE share':>8} {'CPU low-high':>12} "
        f"{'rows ratio':>10} {'in flight':>9} {'in steps':>8}"
    )
    lines = [head, "-" * len(head)]
    for m in modes:
        lines.append(
            f"{m.label:<24} {m.out_tok_s:>9.0f} {m.steps_per_s:>8.1f} {m.rows_per_step:>9.1f} "
            f"{m.ms_per_step:>8.2f} {_fmt(m.step_ms_mean, '>8.2f')} "
            f"{_fmt(m.engine_alone_ms_per_step, '>8.2f')} "
            f"{_fmt(m.frontend_share, '>8.0%')} "
            f"{_fmt(m.cpu_share_low, '>5.0%')} - {_fmt(m.cpu_share_high, '<4.0%')} "
            f"{_fmt(m.rows_ratio, '>10.2f')} {_fmt(m.in_flight_mean, '>9.0f')} "
            f"{_fmt(m.in_steps, '>8.0%')}"
        )
    lines += [
        "",
        f"CPU in cores (CPU seconds / wall seconds; the machine has {os.cpu_count()}): the "
        "engine's process and its threads, the client, every other process of the machine; "
        "then the engine thread's wall time: on a CPU, waiting for one, off CPU (GIL, idle)",
    ]
    head = (
        f"{'mode':<24} {'process':>7} {'loop':>5} {'engine':>6} {'torch':>5} {'other':>5} "
        f"{'client':>6} {'others':>6} | {'on CPU':>6} {'runq':>5} {'off CPU':>7}"
    )
    lines += [head, "-" * len(head)]
    for m in modes:
        cpu = m.server_cpu
        wall = cpu.get("wall_s") or 1.0
        g = {k: v / wall for k, v in cpu.get("groups_cpu_s", {}).items()}
        et = cpu.get("engine_thread_time") or {}
        lines.append(
            f"{m.label:<24} {cpu.get('process_cores', 0.0):>7.2f} {g.get(EVENT_LOOP, 0):>5.2f} "
            f"{g.get(ENGINE, 0):>6.2f} {g.get(WORKERS, 0):>5.2f} {g.get(OTHER, 0):>5.2f} "
            f"{_fmt(m.client_cores, '>6.2f')} {_fmt(m.others_cores, '>6.2f')} | "
            f"{_fmt(et.get('on_cpu'), '>6.0%')} {_fmt(et.get('runqueue'), '>5.0%')} "
            f"{_fmt(et.get('off_cpu'), '>7.0%')}"
        )
    return "\n".join(lines)


def verdict(modes: Sequence[ModeResult]) -> str:
    """One line per HTTP mode: the three front-end shares against the issue's 20% bar."""
    lines = []
    for m in modes:
        if m.mode == "in-process" or m.frontend_share is None:
            continue
        low, high = m.cpu_share_low, m.cpu_share_high
        bounds = "-" if low is None or high is None else f"{low:.0%}-{high:.0%}"
        over = [x for x in (m.frontend_share, low) if x is not None and x > THRESHOLD]
        side = "above" if len(over) == 2 else "not clearly above"
        lines.append(
            f"{m.label}: front-end share {m.frontend_share:.0%} of the engine's steps "
            f"(wall time), {bounds} from CPU time: {side} the {THRESHOLD:.0%} bar"
        )
    return "\n".join(lines) or "no HTTP mode was compared"


# ---- CLI -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.frontend_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens of every request")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight (closed loop)")
    p.add_argument("--prompt-words", default="8,48", help="MIN,MAX prompt words (one token each)")
    p.add_argument("--max-num-seqs", type=int, help="engine rows (default: --concurrency)")
    p.add_argument(
        "--server-args", default="", help="more `beamline serve` flags for both sides, quoted"
    )
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="random model shape")
    p.add_argument("--model", type=Path, help="a random model directory (default: build --shape)")
    p.add_argument(
        "--modes", default="stream,nonstream", help="HTTP modes to run: stream, nonstream"
    )
    p.add_argument(
        "--engine-process",
        default="off,on",
        help="the server's --engine-process settings to run the HTTP modes with, in one run",
    )
    p.add_argument("--poll-s", type=float, default=0.25, help="engine stats sampling period")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help=f"directory for the JSON (default {DEFAULT_OUT_DIR})")
    return p


async def http_warm_up(
    base_url: str, model: str, requests: Sequence[BenchRequest], stream: bool
) -> None:
    target = CompletionTarget(base_url, model)
    send: Send = stream_completion if stream else complete_unstreamed
    async with make_client(len(requests), 60.0) as client:
        await closed_loop(client, target, requests, len(requests), send)


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


def _warm_up(requests: Sequence[BenchRequest], concurrency: int) -> list[BenchRequest]:
    """A few short requests first, unmeasured: first-call costs stay out of the run."""
    return [BenchRequest(r.index, r.prompt, 4) for r in requests[: min(concurrency, 8)]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    lo, hi = (int(x) for x in args.prompt_words.split(","))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= {"stream", "nonstream"}:
        raise SystemExit(f"--modes takes stream and/or nonstream, got {args.modes!r}")
    c = args.concurrency
    engine_settings = [s.strip() for s in args.engine_process.split(",") if s.strip()]
    if not engine_settings or not set(engine_settings) <= {"off", "on", "auto"}:
        raise SystemExit(f"--engine-process takes off, on, auto; got {args.engine_process!r}")
    # speculation off unless asked for: the fit reads rows per step as tokens per step
    server_args = [
        "--max-num-seqs",
        str(args.max_num_seqs or c),
        "--num-speculative-tokens",
        "0",
        *shlex.split(args.server_args),
    ]
    out_dir: Path = args.out or DEFAULT_OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    started = time.monotonic()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_random_model(Path(tmp) / args.shape, args.shape)
        vocab = int(SHAPES[args.shape]["vocab_size"])  # type: ignore[call-overload]

        def workload(salt: str) -> list[BenchRequest]:
            return vocab_workload(args.requests, args.max_tokens, (lo, hi), vocab, args.seed, salt)

        # (b) over HTTP, then (a) in process (no server running meanwhile).
        http: list[ModeResult] = []
        for setting in engine_settings:  # each a server of its own, one after the other
            log_path = out_dir / f"frontend-cost-server-{setting}.log"
            flags = [*server_args, "--engine-process", setting]
            with launched_server(model_dir, flags, log_path) as (base_url, proc, names):
                model_name = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
                for mode in modes:
                    stream = mode == "stream"
                    warm = _warm_up(workload(f"warm-{mode}"), c)
                    asyncio.run(http_warm_up(base_url, model_name, warm, stream))
                    requests = workload(mode)
                    pid, poll = proc.pid, args.poll_s
                    run = http_run(base_url, model_name, requests, c, stream, pid, names, poll)
                    result = asyncio.run(run)
                    http.append(result)
                    print(f"{result.label}: {result.out_tok_s:.0f} tok/s", file=sys.stderr)

        # (a) in process, at C and at each HTTP mode's rows per step (the comparable width).
        with process_state_restored():
            inproc = InProcess(model_dir, [*server_args, "--engine-process", "off"])
            torch_threads = torch.get_num_threads()  # as the server set it from the same flags
            inproc.run(_warm_up(workload("warm-inproc"), c), c, record=False)
            inprocess = [
                inproc.run(workload(f"inproc-{width}"), width)
                for width in sorted({c, max(1, c // 2), max(1, c // 4)}, reverse=True)
            ]
            model = StepModel.fit(inproc.steps)
            del inproc
    for m in (*inprocess, *http):
        compare(m, model, inprocess[0], min(args.max_num_seqs or c, m.concurrency))

    results = [*inprocess, *http]
    busy = load_start[0] > (os.cpu_count() or 1) / 2
    report: dict[str, Any] = {
        "benchmark": "frontend_cost",
        "config": {
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "concurrency": c,
            "prompt_words": [lo, hi],
            "shape": args.shape,
            "server_args": server_args,
            "modes": modes,
            "engine_process": engine_settings,
            "seed": args.seed,
            "torch_threads": torch_threads,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": list(load_start),
            "loadavg_end": list(os.getloadavg()),
            "busy_at_start": busy,
        },
        "definitions": {
            "engine_alone_s": "seconds the engine alone (in process) would take for the run's "
            "steps, tokens computed and rows sampled, from `step_model`",
            "frontend_share": "1 - engine_alone_s / wall_s: the fraction of the engine's steps "
            "(at the same batch shape) lost when served over HTTP; ~0 for in-process runs",
            "cpu_share_low": "1 - engine_alone_s / CPU seconds of the engine thread",
            "cpu_share_high": "1 - engine_alone_s / CPU seconds of the engine thread and the "
            "event loop together",
            "rows_ratio": "engine-alone tok/s on the run's batch shape / in-process tok/s at "
            "the full concurrency: the cost of the narrower batches alone",
            "cores": "CPU seconds / wall seconds of the run",
        },
        "step_model": asdict(model),
        "missing_counters": MISSING_COUNTERS,
        "results": [asdict(r) for r in results],
        "verdict": verdict(http),
        "wall_s": time.monotonic() - started,
    }
    path = out_dir / "frontend_cost.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"torch intra-op threads: {torch_threads}; server flags: {shlex.join(server_args)}")
    print(model.describe())
    print(format_table(results))
    print()
    print(verdict(http))
    if busy:
        print(f"note: load average {load_start[0]:.1f} at the start: numbers may be noisy")
    print(f"JSON: {path}")
    return report


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":  # the server side of launched_server
        sys.exit(_serve_with_thread_names(sys.argv[2], sys.argv[3:]))
    try:
        main()
    except LaunchError as exc:
        print(f"frontend_cost: {exc}", file=sys.stderr)
        sys.exit(2)
