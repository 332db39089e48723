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
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.frontend.http import http_run, http_warm_up, launched_server
from benchmarks.frontend.in_process import InProcess, process_state_restored
from benchmarks.frontend.report import MISSING_COUNTERS, format_table, verdict
from benchmarks.frontend.results import ModeResult
from benchmarks.frontend.step_model import StepModel, compare
from benchmarks.frontend.workload import vocab_workload, warm_up_requests
from benchmarks.launch import LaunchError
from benchmarks.random_models import SHAPES, build_random_model
from benchmarks.workload import BenchRequest

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"


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
                    warm = warm_up_requests(workload(f"warm-{mode}"), c)
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
            inproc.run(warm_up_requests(workload("warm-inproc"), c), c, record=False)
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
    try:
        main()
    except LaunchError as exc:
        print(f"frontend_cost: {exc}", file=sys.stderr)
        sys.exit(2)
