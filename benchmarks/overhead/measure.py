"""One (kind, rows) pair on the loaded engine: rows of greedy, sampled or beam requests submitted
and prefilled, their decode steps timed (whole, forward, render; then a free step), the requests
aborted and every KV block checked back."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.overhead.timers import ForwardTimer, RenderTimer, forward_path
from decoding import DecodingParams
from server.engine.request import EngineRequest
from server.loading import LoadedEngine

PROMPT_TOKENS = 8
BEAMS = 4
KINDS: dict[str, Callable[[int], DecodingParams]] = {
    "greedy": lambda i: DecodingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0),
    "sampled": lambda i: DecodingParams(
        max_tokens=100_000,
        ignore_eos=True,
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        repetition_penalty=1.1,
        seed=i,
    ),
    "beam": lambda i: DecodingParams(
        max_tokens=100_000, ignore_eos=True, temperature=0.0, num_beams=BEAMS
    ),
}


@dataclass
class Result:
    kind: str
    rows: int
    steps: int
    step_ms: float  # medians over the timed steps
    forward_ms: float
    host_ms: float
    host_ms_mean: float
    render_ms: float = 0.0  # with overlap_outputs: the part of host_ms rendered during a forward
    exposed_ms: float = 0.0  # host_ms - render_ms
    free_step_ms: float = 0.0  # median step time with nothing timed inside (no device syncs)
    step_per_forward: float = 0.0  # free_step_ms / forward_ms
    path: str = ""  # the timed steps' forward: graphs (every one replayed), paged or gather
    graph_steps: int = 0  # timed steps that replayed a CUDA graph
    overlap_outputs: bool = False
    async_scheduling: bool = False


def measure(
    loaded: LoadedEngine,
    timer: ForwardTimer,
    render: RenderTimer,
    kind: str,
    rows: int,
    steps: int,
    *,
    pair: int = 0,
    warmup: int = 5,
    prompt_tokens: int = PROMPT_TOKENS,
) -> Result:
    """One (kind, rows) pair on the loaded engine: submit, prefill, time, abort; every KV block
    must be back in the pool afterwards (the next pair starts from an empty engine)."""
    engine = loaded.engine
    rows = row_count(kind, rows)
    requests = rows // (BEAMS if kind == "beam" else 1)
    outputs: deque[object] = deque(maxlen=4096)  # emitted outputs, dropped as a client would
    vocab = loaded.runner.vocab_size
    ids = [f"{kind}-{rows}-{i}" for i in range(requests)]
    for i, request_id in enumerate(ids):  # `pair` apart: no prefix-cache hit on an earlier pair
        prompt = [4 + (pair * 101 + i * 7 + j * 13) % (vocab - 4) for j in range(prompt_tokens)]
        engine.submit(EngineRequest(request_id, prompt, KINDS[kind](i), outputs.append))
    timer.enabled = False
    while engine.num_waiting or engine.scheduler.num_running_rows < rows:
        engine.step()
    for _ in range(warmup):
        engine.step()
    gc.collect()
    gc.freeze()  # as the server does after start-up (bootstrap.py)
    step_ms, forward_ms, render_ms, free_ms = [], [], [], []
    graph_steps = 0
    for _ in range(steps):
        timer.seconds = render.seconds = 0.0
        replays = timer.replays
        timer.enabled = True
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        forward_ms.append(timer.seconds * 1e3)
        render_ms.append(render.seconds * 1e3)
        graph_steps += timer.replays > replays
        timer.enabled = False  # then one step with nothing synchronising the device inside
        start = time.perf_counter()
        engine.step()
        free_ms.append((time.perf_counter() - start) * 1e3)
    for request_id in ids:
        engine.abort(request_id)
    while engine.step():
        pass
    if engine.num_running or engine.num_waiting or engine.pool.num_free != engine.pool.num_blocks:
        raise RuntimeError(
            f"{kind} x {rows}: after the aborts {engine.num_running} running, "
            f"{engine.num_waiting} waiting, {engine.pool.num_free} of "
            f"{engine.pool.num_blocks} KV blocks free"
        )
    host = [s - f for s, f in zip(step_ms, forward_ms)]
    free, forward = statistics.median(free_ms), statistics.median(forward_ms)
    return Result(
        kind,
        rows,
        steps,
        statistics.median(step_ms),
        statistics.median(forward_ms),
        statistics.median(host),
        statistics.fmean(host),
        statistics.median(render_ms),
        statistics.median(h - r for h, r in zip(host, render_ms)),
        free,
        free / forward if forward else 0.0,
        "graphs" if graph_steps == steps else forward_path(loaded.runner),
        graph_steps,
        engine.overlap_outputs,
        engine.async_scheduling,
    )


def row_count(kind: str, rows: int) -> int:
    """The rows of a pair: whole requests (a beam request has BEAMS rows), at least one."""
    per_request = BEAMS if kind == "beam" else 1
    return max(1, rows // per_request) * per_request
