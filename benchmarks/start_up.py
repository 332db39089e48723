"""Seconds from `beamline serve` to its first answer: a fresh start (an empty cache: the GGUF file
converted, the decode step compiled while serving), then plain starts (`--no-torch-compile`) and
later starts (the default, the compiled step in the cache) in turns, and llama.cpp's
`llama-server` on the same GGUF file in the same turns when it can be built here.

    python -m benchmarks.start_up --runs 3                 # the default (compiled on a CPU that
                                                           # takes w8a8 and has a C++ compiler)
    python -m benchmarks.start_up --args "--quantization w8a8 --torch-compile"

Each start is timed three ways from the command's launch: GET /health answers 200, the first
completion (8 tokens) is back, and the compiled decode step is in use (`decode_step` of
/v1/engine/stats; the plain starts never compile). Every start uses one cache directory
(`--cache-dir`, default a fresh temporary one), empty before the fresh start. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.launch import LaunchError, first_model_id, start_beamline, stop, wait_compiled
from benchmarks.machine import cpu_identity
from server.model.loader import default_gguf_path


@dataclass
class Start:
    healthy_s: float  # GET /health answers 200
    answered_s: float  # the first completion is back
    compiled_s: float | None  # the compiled decode step is in use (None: it never was)


def first_completion(base_url: str) -> None:
    """One 8-token completion, as a first client would send it."""
    body = {"model": first_model_id(base_url), "prompt": "The capital of France is"}
    body |= {"max_tokens": 8, "temperature": 0}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=600.0)
    response.raise_for_status()


def time_start(model: str | None, cache: Path, args: list[str], log: Path) -> Start:
    """A `beamline serve` started fresh, timed from its launch (the Python interpreter's start
    included), stopped once its compiled step is in use or it says it will not compile."""
    launched = time.monotonic()
    proc, url, _ = start_beamline(model, log, ["--cache-dir", str(cache), *args], compiled=False)
    try:
        healthy = time.monotonic() - launched
        first_completion(url)
        answered = time.monotonic() - launched
        wait_compiled(url, 1800.0, proc)
        compiled = time.monotonic() - launched
        state = httpx.get(url + "/v1/engine/stats", timeout=30.0).json().get("decode_step")
        return Start(healthy, answered, compiled if state == "compiled" else None)
    finally:
        stop(proc)


def time_llama_server(gguf: Path, log: Path) -> Start | None:
    """The same timings of llama.cpp's server on `gguf` (None: it cannot be built here)."""
    from benchmarks.serving import llama_server

    try:
        binary = llama_server.build()
    except (LaunchError, OSError, RuntimeError) as error:
        print(f"llama-server not timed: {error}", file=sys.stderr)
        return None
    launched = time.monotonic()
    with llama_server.launched(binary, gguf, 1, log) as url:
        healthy = time.monotonic() - launched
        first_completion(url)
        return Start(healthy, time.monotonic() - launched, None)


def median_of(starts: list[Start], field: str) -> float | None:
    values = [v for s in starts if (v := getattr(s, field)) is not None]
    return statistics.median(values) if values else None


def table(rows: list[tuple[str, list[Start]]]) -> str:
    lines = ["| start | runs | healthy s | first answer s | compiled step in use s |"]
    lines.append("|---|---|---|---|---|")
    for name, starts in rows:
        cells = [median_of(starts, f) for f in ("healthy_s", "answered_s", "compiled_s")]
        shown = " | ".join("-" if c is None else f"{c:.1f}" for c in cells)
        lines.append(f"| {name} | {len(starts)} | {shown} |")
    return "\n".join(lines) + "\n(medians over the runs)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--gguf", type=Path, default=None, help="llama-server's model file")
    parser.add_argument("--args", default="", help="the compiled starts' flags (default: none)")
    parser.add_argument("--runs", type=int, default=3, help="plain and later starts each")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/beamline-bench/start_up.json"))
    opts = parser.parse_args(argv)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # beamline's own cache, as a user gets it
    cache = opts.cache_dir or Path(tempfile.mkdtemp(prefix="beamline-start-up-"))
    if cache.exists() and any(cache.iterdir()):
        parser.error(f"{cache} is not empty: the fresh start needs an empty cache")
    compiled_args = shlex.split(opts.args)
    plain_args = [a for a in compiled_args if a != "--torch-compile"] + ["--no-torch-compile"]
    gguf = opts.gguf or (None if opts.model else default_gguf_path())
    logs = opts.out.parent / "start_up_logs"
    print(f"cache {cache}; the fresh start converts the model and compiles", file=sys.stderr)
    fresh = time_start(opts.model, cache, compiled_args, logs / "fresh.log")
    plain: list[Start] = []
    later: list[Start] = []
    peer: list[Start] = []
    for run in range(opts.runs):  # in turns, so that a drifting machine moves each alike
        plain.append(time_start(opts.model, cache, plain_args, logs / f"plain-{run}.log"))
        later.append(time_start(opts.model, cache, compiled_args, logs / f"later-{run}.log"))
        if gguf is not None and not opts.no_llama_server:
            if (timed := time_llama_server(gguf, logs / f"llama-server-{run}.log")) is not None:
                peer.append(timed)
    rows = [
        (f"fresh (empty cache): {shlex.join(compiled_args) or '(defaults)'}", [fresh]),
        (f"plain: {shlex.join(plain_args)}", plain),
        (f"later: {shlex.join(compiled_args) or '(defaults)'}", later),
    ]
    if peer:
        rows.append((f"llama-server on {gguf.name if gguf else '?'}", peer))
    print(table(rows))
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "host_cpu": cpu_identity(),
        "cores": os.cpu_count(),
        "plain_args": plain_args,
        "compiled_args": compiled_args,
        "fresh": asdict(fresh),
        "plain": [asdict(s) for s in plain],
        "later": [asdict(s) for s in later],
        "llama_server": [asdict(s) for s in peer],
    }
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
