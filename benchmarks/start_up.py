"""Seconds from `beamline serve` to a healthy server: a first start that converts the model (a GGUF
file, plain), a plain start (`--no-torch-compile`), a first compiled start (nothing compiled in the
cache), and later compiled starts that load the cache.

    python -m benchmarks.start_up --runs 3                 # the default (compiled on a CPU that
                                                           # takes w8a8 and has a C++ compiler)
    python -m benchmarks.start_up --args "--quantization w8a8 --torch-compile"

Every start uses one cache directory (`--cache-dir`, default a fresh temporary one): the model is
converted by the first start, and the compiled entries (`<cache>/compiled`, inductor's
kernels included) are removed before the first compiled start only. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launch import launched_beamline
from benchmarks.machine import cpu_identity


def time_start(model: str | None, cache: Path, args: list[str], log: Path) -> float:
    """Seconds until GET /health answers 200, the process started fresh."""
    with launched_beamline(model, log, ["--cache-dir", str(cache), *args]) as (_, ready):
        return ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--args", default="", help="the compiled starts' flags (default: none)")
    parser.add_argument("--runs", type=int, default=3, help="plain and warm compiled starts each")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp/beamline-bench/start_up.json"))
    opts = parser.parse_args(argv)
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # beamline's own cache, as a user gets it
    cache = opts.cache_dir or Path(tempfile.mkdtemp(prefix="beamline-start-up-"))
    compiled_args = shlex.split(opts.args)
    plain_args = [a for a in compiled_args if a != "--torch-compile"] + ["--no-torch-compile"]
    logs = opts.out.parent / "start_up_logs"
    print(f"cache {cache}; the first start converts the model", file=sys.stderr)
    converting = time_start(opts.model, cache, plain_args, logs / "convert.log")
    shutil.rmtree(cache / "compiled", ignore_errors=True)
    first = time_start(opts.model, cache, compiled_args, logs / "first.log")
    plain, warm = [], []
    for run in range(opts.runs):  # alternated, so that a drifting machine moves both alike
        plain.append(time_start(opts.model, cache, plain_args, logs / f"plain-{run}.log"))
        warm.append(time_start(opts.model, cache, compiled_args, logs / f"warm-{run}.log"))
    rows = [
        (f"converting, plain: {shlex.join(plain_args)}", [converting]),
        (f"plain: {shlex.join(plain_args) or '(defaults)'}", plain),
        (f"first compiled: {shlex.join(compiled_args) or '(defaults)'}", [first]),
        (f"later compiled: {shlex.join(compiled_args) or '(defaults)'}", warm),
    ]
    print("| start | runs | min s | median s | max s |\n|---|---|---|---|---|")
    for name, times in rows:
        print(
            f"| {name} | {len(times)} | {min(times):.1f} | {statistics.median(times):.1f} "
            f"| {max(times):.1f} |"
        )
    ratio = statistics.median(warm) / statistics.median(plain)
    print(f"later compiled / plain start (medians): {ratio:.2f}x")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "host_cpu": cpu_identity(),
        "cores": os.cpu_count(),
        "plain_args": plain_args,
        "compiled_args": compiled_args,
        "converting_start_s": converting,
        "plain_s": plain,
        "first_compiled_s": first,
        "later_compiled_s": warm,
    }
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
