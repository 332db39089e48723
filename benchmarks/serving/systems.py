"""The servers under test: the launched (or given) one and each `--compare-beamline` variant,
under the load at every level, or the request sets of `--structured` and `--beam-case`."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from collections.abc import Callable

from tqdm.auto import tqdm

from benchmarks.client import (
    CompletionTarget,
    level_requests,
    make_client,
    run_concurrency,
    run_poisson,
    stream_completion,
)
from benchmarks.launch import LaunchError, first_model_id, launched_beamline
from benchmarks.serving.beam_case import engine_stats, run_beam_case
from benchmarks.serving.report import Run, SystemResult
from benchmarks.serving.results import Progress, server_log_path
from benchmarks.serving.structured import run_structured
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest, Workload


async def bench_server(
    args: argparse.Namespace,
    target: CompletionTarget,
    workload: Workload,
    label: str | None = None,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> SystemResult:
    """The load at every level; `on_run` gets the result after each level (it writes the JSON)."""
    label = label or args.label
    async with make_client(1, target.request_timeout_s, target.api_key) as client:
        for i in range(args.warmup):
            await stream_completion(
                client, target, BenchRequest(-1 - i, workload.requests[0].prompt, 4)
            )
    result = SystemResult(
        label, label, "server", info={"base_url": target.base_url, "model": target.model}
    )
    for level in args.levels:
        if args.mode == "concurrency":
            requests = level_requests(workload.requests, int(level), args.rounds)
            res, dur = await run_concurrency(target, requests, int(level), f"{label} c={level:g}")
        else:
            res, dur = await run_poisson(
                target,
                workload.requests,
                level,
                args.seed,
                args.max_concurrency,
                f"{label} rate={level:g}",
            )
        result.runs.append(Run(level, summarize(res, dur)))
        on_run(result)
        m = result.runs[-1].metrics
        tqdm.write(
            f"{label} {'c' if args.mode == 'concurrency' else 'rate'}={level:g}: "
            f"{m['output_throughput']:.1f} out tok/s, {m['errors']} errors",
            file=sys.stderr,
        )
    async with make_client(1, 30.0, target.api_key) as client:
        stats = await engine_stats(client, target.base_url.rstrip("/"))
    if stats:
        result.info["engine_stats_after"] = stats
    return result


async def _measure(
    args: argparse.Namespace,
    base_url: str,
    workload: Workload,
    label: str | None = None,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> tuple[SystemResult | dict, str]:
    model = args.model_name or first_model_id(base_url, args.api_key)
    if args.structured:
        levels = [int(c) for c in args.levels]
        return await run_structured(base_url, model, levels, args.api_key), model
    if args.beam_case:
        res = await run_beam_case(
            base_url, model, args.beam_max_tokens, args.ignore_eos, api_key=args.api_key
        )
        return res, model
    target = CompletionTarget(
        base_url,
        model,
        args.ignore_eos,
        args.request_timeout,
        api_key=args.api_key,
        chat=workload.chat,
    )
    return await bench_server(args, target, workload, label, on_run), model


def dtype_args(args: argparse.Namespace) -> list[str]:
    """`--dtype` for a launched beamline only when given: left out, beamline serves its default
    (the fast CPU default, or bfloat16 on CUDA), which is what its users get."""
    return ["--dtype", args.dtype] if args.dtype else []


def measure_server(
    args: argparse.Namespace,
    workload: Workload,
    on_run: Callable[[SystemResult], None] = lambda result: None,
) -> tuple[SystemResult | dict, dict]:
    """Run the load (or the beam case) against the launched or given server."""
    if not args.launch_beamline:
        res, model = asyncio.run(_measure(args, args.base_url, workload, on_run=on_run))
        return res, {"base_url": args.base_url, "model_name": model}
    extra = [*dtype_args(args), "--device", args.device, *shlex.split(args.beamline_args)]
    with launched_beamline(args.model, server_log_path(args), extra, args.launch_timeout) as (
        url,
        ready_s,
    ):
        print(f"beamline healthy after {ready_s:.1f} s at {url}", file=sys.stderr)
        res, model = asyncio.run(_measure(args, url, workload, on_run=on_run))
    return res, {
        "base_url": url,
        "model_name": model,
        "launch_seconds_to_healthy": ready_s,
        "launch_args": extra,
    }


def measure_variants(args: argparse.Namespace, workload: Workload, progress: Progress) -> bool:
    """Each --compare-beamline configuration, launched in turn on the same workload and loads;
    False if one could not start (listed under `skipped`, and the next one runs)."""
    started_all = True
    for label, flags in args.variants:
        extra = [*dtype_args(args), "--device", args.device, *shlex.split(flags)]
        log_path = server_log_path(args).with_name(f"beamline-{label}.log")

        def on_run(result: SystemResult, extra: list[str] = extra) -> None:
            result.kind = "server-variant"
            result.info["launch_args"] = extra
            progress.add(result)

        try:
            with launched_beamline(args.model, log_path, extra, args.launch_timeout) as (url, _):
                asyncio.run(_measure(args, url, workload, label, on_run))
        except LaunchError as exc:
            print(f"benchmarks.serve: could not start {label!r}: {exc}", file=sys.stderr)
            progress.skipped[label] = f"could not start beamline {' '.join(extra)}: {exc}"
            progress.write()
            started_all = False
    return started_all
