"""`python -m benchmarks.two_models`: two models from one server against two one-model servers.

The same closed-loop load goes to two models at once, half the concurrency each (c = 16: 8
streams per model), greedy, ignore_eos:
- **one server**: `beamline serve MODEL --extra-models second=SECOND`, requests naming either;
  both models' rows run in the same engine steps;
- **two servers** on the same cores, one per model, each with torch's default threads (one per
  core: the cores oversubscribed) and again with the cores shared out (`--num-threads` cores/2):
  the faster of the two is the baseline.

Each configuration runs `--rounds` rounds after a warm-up; the result is the total output
throughput of both models (all tokens over the wall time of the slower half) and the memory of
every server process (proportional set size, summed over each server's process tree: weights
mapped by both count once). Without `--second`, the second model is the served model's own
weights under another name (the default model's GGUF file), so the two halves cost the same.
Speculation and prefix caching are off in every server: rounds would reuse each other's blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from benchmarks.client import CompletionTarget, run_concurrency
from benchmarks.launch import first_model_id, start_beamline, stop
from benchmarks.load_runs import load_parser, run_and_write
from benchmarks.machine import machine_info
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest, synthetic_workload
from server.docgen.published import reproducing_command

FIXED_ARGS = ["--num-speculative-tokens", "0", "--no-enable-prefix-caching"]


def pss_bytes(pid: int) -> int:
    """The proportional set size of `pid` and its children: pages shared between processes
    (the same file mapped twice) split among them."""
    total = 0
    root = psutil.Process(pid)
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error, OSError):
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


@contextlib.contextmanager
def servers(
    launches: list[tuple[str | None, list[str]]], logs: str, timeout_s: float
) -> Iterator[list[tuple[str, int]]]:
    """Start every (model, args) server, one after another, each logging to `logs`-i.log;
    yield their (URL, pid)."""
    started = []
    try:
        for i, (model, args) in enumerate(launches):
            proc, url, _ = start_beamline(model, Path(f"{logs}-{i}.log"), args, timeout_s)
            started.append((proc, url))
        yield [(url, proc.pid) for proc, url in started]
    finally:
        for proc, _ in started:
            stop(proc)


async def both_halves(
    targets: list[CompletionTarget], requests: tuple[BenchRequest, ...], concurrency: int
) -> dict:
    """Both targets loaded at once, `concurrency` / 2 streams each: total output tok/s."""
    half = max(1, concurrency // 2)
    start = time.perf_counter()
    runs = await asyncio.gather(*(run_concurrency(t, requests, half, t.model) for t in targets))
    wall = time.perf_counter() - start
    parts = [summarize(results, seconds) for results, seconds in runs]
    tokens = sum(p["total_output_tokens"] for p in parts)
    return {
        "seconds": wall,
        "output_throughput": tokens / wall,
        "errors": sum(p["errors"] for p in parts),
        "per_model": [{"model": t.model, **p} for t, p in zip(targets, parts)],
    }


async def measure(
    urls: list[tuple[str, int]], names: list[str], args: argparse.Namespace, label: str
) -> dict:
    """Warm-up, then the rounds at each concurrency, and the servers' memory after."""
    workload = synthetic_workload(args.num_requests, output_tokens=(32, 64), seed=0)
    if len(urls) == 1:  # one server, each half naming its model
        targets = [CompletionTarget(urls[0][0], name) for name in names]
    else:
        targets = [CompletionTarget(url, first_model_id(url)) for url, _ in urls]
    levels: dict[str, dict] = {}
    for c in args.concurrency:
        await both_halves(targets, workload.requests[:2], 2)
        rounds = [await both_halves(targets, workload.requests, c) for _ in range(args.rounds)]
        best = statistics.median(r["output_throughput"] for r in rounds)
        levels[f"c{c}"] = {"median_output_throughput": best, "rounds": rounds}
        print(f"{label} c={c}: {best:.1f} out tok/s (both models)", flush=True)
    memory = sum(pss_bytes(pid) for _, pid in urls)
    return {"levels": levels, "pss_bytes": memory}


async def run(args: argparse.Namespace) -> dict:
    second = args.second or args.model
    if second is None:  # the default model under a second name: its GGUF file
        from server.model.loader import default_gguf_path

        second = str(default_gguf_path())
    common = [*FIXED_ARGS, *args.beamline_args.split()]
    one = [(args.model, [*common, "--extra-models", f"second={second}"])]
    with servers(one, str(args.out_dir / "one-server"), args.launch_timeout) as urls:
        name = first_model_id(urls[0][0])
        results = {"one_server": await measure(urls, [name, "second"], args, "one server")}
    share = str(max(1, (os.cpu_count() or 1) // 2))
    for key, extra in (("two_servers", []), ("two_servers_shared_cores", ["--num-threads", share])):
        pair = [(args.model, [*common, *extra]), (second, [*common, *extra])]
        with servers(pair, str(args.out_dir / key.replace("_", "-")), args.launch_timeout) as urls:
            results[key] = await measure(urls, [], args, key.replace("_", " "))
    summary = {}
    for c in args.concurrency:
        level = f"c{c}"
        mine = results["one_server"]["levels"][level]["median_output_throughput"]
        baselines = {k: results[k]["levels"][level]["median_output_throughput"]
                     for k in ("two_servers", "two_servers_shared_cores")}  # fmt: skip
        baseline = max(baselines, key=baselines.__getitem__)
        summary[level] = {
            "one_over_two_throughput": mine / baselines[baseline],
            "baseline": baseline,
            "goal_at_least": 1.0,
            "met": mine >= baselines[baseline],
            "one_over_two_memory": results["one_server"]["pss_bytes"]
            / results[baseline]["pss_bytes"],
        }
    return {
        "benchmark": "two_models",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "command": reproducing_command("benchmarks.two_models", args.argv, ("--out", "--out-dir")),
        "model": args.model or "default",
        "second": args.second or "the served model's weights under a second name",
        "server_args": common,
        "results": results,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = load_parser(__doc__, "two-models")
    p.set_defaults(concurrency=[16])
    p.add_argument("--second", help="the second model (default: the served model's weights)")
    args, result, out = run_and_write(p, argv, run, "two-models")
    for key, s in result["summary"].items():
        print(
            f"{key}: one server / two servers ({s['baseline']}) throughput "
            f"{s['one_over_two_throughput']:.2f}x (goal >= 1.0x), memory "
            f"{s['one_over_two_memory']:.2f}x"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
