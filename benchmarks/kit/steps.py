"""A plan's steps, in order: the commands (tests, then per shape: the model's build on the device,
engine_overhead, serve), their logs and results, their shares of the budget, what each needs."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.kit.plans import EAGER


@dataclass
class Step:
    name: str
    cmd: list[str]
    log: Path
    weight: float  # share of the time left, against the steps still to run
    floor_s: float  # at least this long, if the budget still has it
    needs: str | None = None  # a step that must have succeeded first
    result: Path | None = None  # the JSON the step writes (headline figures)
    first_signal: signal.Signals | None = None  # sent to the step's process first at its deadline
    record: dict = field(default_factory=dict)


def build_steps(args: argparse.Namespace, work: Path, models: Path) -> list[Step]:
    py = sys.executable
    steps = []
    if args.tests:
        cmd = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--maxfail={args.maxfail}"]
        cmd += [f"--junitxml={work / 'tests' / 'tests.xml'}", "--durations=25"]
        if importlib.util.find_spec("pytest_timeout") is not None:  # a wheel to bring there
            cmd += [f"--timeout={args.test_timeout}"]
        log = work / "tests" / "tests.log"
        steps.append(
            Step(
                "tests", cmd + args.tests, log, weight=3.0, floor_s=60.0, first_signal=signal.SIGINT
            )
        )
    levels = [int(c) for c in args.concurrency.split(",")]
    for shape in args.shapes:
        model, folder = models / shape, work / shape
        build = BUILD.format(shape=shape, dtype=args.dtype, device=args.device)
        cmd = [py, "-c", build, str(model)]
        steps.append(Step(f"{shape}: build", cmd, folder / "build.log", weight=0.5, floor_s=90.0))
        cmd = [py, "-m", "benchmarks.engine_overhead", "--model", str(model), "--device"]
        cmd += [args.device, "--rows", args.rows, "--steps", str(args.steps)]
        cmd += ["--out", str(folder / "overhead.json")]
        steps.append(
            Step(
                f"{shape}: engine overhead",
                cmd,
                folder / "overhead.log",
                weight=1.0,
                floor_s=60.0,
                needs=f"{shape}: build",
                result=folder / "overhead.json",
            )
        )
        seqs = f" --max-num-seqs {max(levels)}" if max(levels) > 64 else ""  # else the default
        cmd = [py, "-m", "benchmarks.serve", "--launch-beamline", "--model", str(model)]
        cmd += ["--device", args.device, "--dtype", args.dtype, "--baselines", "hf-static"]
        cmd += ["--concurrency", args.concurrency, "--num-requests", str(args.num_requests)]
        cmd += ["--output-tokens", args.output_tokens, "--out-dir", str(folder), "--tag", "serve"]
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        cmd += ["--label", "beamline", f"--beamline-args={seqs.strip()}"]
        cmd += ["--launch-timeout", f"{min(300.0, args.budget / 2):.0f}"]  # compiling: minutes
        if args.variants:
            cmd += ["--compare-beamline", f"eager={EAGER}{seqs}"]
            cmd += ["--compare-beamline", f"compiled=--torch-compile{seqs}"]
        steps.append(
            Step(
                f"{shape}: serve",
                cmd,
                folder / "serve.log",
                weight=3.0,
                floor_s=120.0,
                needs=f"{shape}: build",
                result=folder / "serve.json",
            )
        )
    return steps


# The random model, built on the device into a folder renamed once whole: a build cut short leaves
# no model behind for a later call with the same --work (which reuses a whole one).
BUILD = """
import os, shutil, sys, torch
from benchmarks.random_models import build_random_model
model, part = sys.argv[1], sys.argv[1] + ".partial"
if not os.path.exists(model):
    shutil.rmtree(part, ignore_errors=True)
    build_random_model(part, {shape!r}, dtype=torch.{dtype}, device={device!r})
    os.replace(part, model)
"""
