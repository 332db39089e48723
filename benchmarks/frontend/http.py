"""(b) Over HTTP: `beamline serve` launched in a subprocess (through thread_names.py) under the same
closed loop, streaming or not; the engine's counters from GET /v1/engine/stats and /metrics around
the run, the CPU of every server thread and of the client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import httpx

from benchmarks.client import CompletionTarget, make_client, stream_completion
from benchmarks.frontend.cpu import (
    ENGINE,
    EVENT_LOOP,
    OTHER,
    WORKERS,
    cpu_split,
    engine_processes,
    process_cpu_s,
    server_threads,
    system_busy_s,
    thread_samples,
)
from benchmarks.frontend.results import Counters, ModeResult, mode_result
from benchmarks.launch import REPO_ROOT, free_port, stop, wait_healthy
from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest

ENGINE_THREAD = "beamline-engine"  # server/engine/async_engine.py names its loop thread so


@contextlib.contextmanager
def launched_server(
    model_dir: Path, server_args: Sequence[str], log_path: Path, timeout_s: float = 300.0
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """`beamline serve` on a free loopback port (as benchmarks/launch.py starts it), through the
    thread-naming wrapper (thread_names.py); yields (base_url, process, file of thread names)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    names = log_path.with_suffix(".threads")
    names.unlink(missing_ok=True)
    server_argv = ["--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir)]
    cmd = [sys.executable, "-m", "benchmarks.frontend.thread_names", str(names), *server_argv]
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


async def http_warm_up(
    base_url: str, model: str, requests: Sequence[BenchRequest], stream: bool
) -> None:
    target = CompletionTarget(base_url, model)
    send: Send = stream_completion if stream else complete_unstreamed
    async with make_client(len(requests), 60.0) as client:
        await closed_loop(client, target, requests, len(requests), send)


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
    out = mode_result(mode, concurrency, results, wall, before, after)
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
