"""What the closed-loop comparison benchmarks share (benchmarks/lm_fusion.py,
benchmarks/draft_speculation.py): their common flags, one timed load, and writing the JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchmarks.client import CompletionTarget, run_concurrency
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest

OUT_DIR = Path(__file__).resolve().parent / "results"


def load_parser(doc: str | None, out_name: str) -> argparse.ArgumentParser:
    """A parser with the flags every such benchmark takes (its own are added after)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--model", help="HF directory, .gguf or hub id (default: Gemma 3 270M)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--beamline-args", default="", help="more `beamline serve` flags, all servers")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument(
        "--out", type=Path, help=f"JSON result (default: <out-dir>/{out_name}-<date>.json)"
    )
    return p


def run_and_write(
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], Awaitable[dict]],
    out_name: str,
) -> tuple[argparse.Namespace, dict, Path]:
    """Parse `argv`, run the benchmark, write its JSON; (args, result, where it went)."""
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    out = args.out or args.out_dir / f"{out_name}-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return args, result, out


async def timed(
    target: CompletionTarget, requests: tuple[BenchRequest, ...], concurrency: int, label: str
) -> dict:
    """The load's wall time and throughput (output tokens per second)."""
    results, duration = await run_concurrency(target, requests, concurrency, label)
    metrics = summarize(results, duration)
    print(
        f"{label}: {duration:.1f} s, {metrics['output_throughput']:.1f} out tok/s, "
        f"{metrics['errors']} errors",
        file=sys.stderr,
    )
    return {"seconds": duration, **metrics}
