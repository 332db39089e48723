"""The GPU kit: what a lent GPU machine should run, as one command that fits a 10-minute command.

    python -m benchmarks.gpu_kit --out "$OUT"                 # first contact: about 6 minutes
    python -m benchmarks.gpu_kit --out "$OUT" --plan full     # later: 1B and 8B, every variant
    python -m benchmarks.gpu_kit --out OUT --device cpu --shapes tiny --concurrency 1,2 \\
        --num-requests 4 --output-tokens 4,8 --rows 4 --tests tests/test_detokenizer.py  # CI

Plans (first-contact is the default: the first call on a GPU should be the short one that shows
what breaks there, and leave the time to run again):
- first-contact: the tests that matter on CUDA (FIRST_CONTACT_TESTS), then one Llama-3.2-1B-shaped
  random model (bfloat16, built on the device): the engine's host time per step at 16 and 64 rows
  and serving at c = 1 and 16 (32 requests) against HF `generate()` static batching, beamline as
  it starts on CUDA (paged kernel, start-up CUDA graphs, overlapped outputs, async scheduling);
- full: every model-running test (KIT_TESTS), then Llama-3.2-1B and Llama-3.1-8B shapes: host
  time at 16, 64 and 256 rows, serving at c = 1, 16, 64, 256 (2 rounds of each level: 8 requests
  at c = 1, 256 at c = 256): the default, plain
  eager (`--no-cuda-graphs --overlap-outputs off --async-scheduling off`) and `--torch-compile`.

Steps run in order, each in a process group of its own with a deadline (its share of `--budget`,
what earlier steps left included): a step that fails or runs out of time is recorded and the next
one runs; a deadline ends the step's whole group (a launched server and its engine process
too), and so does SIGTERM to the kit. After every step OUT holds, each file rewritten atomically:
- kit.json: per step its status (ok, failed, timeout, skipped, running, stopped), exit code,
  seconds and headline figures (tests passed / failed, host ms per step, out tok/s per system
  and concurrency), so that one file tells how far the run got and what it measured;
- tests.xml: pytest's JUnit report;
- results.tar.gz: every JSON / PNG result;  logs.tar.gz: every log (tests, builds, benchmarks,
  launched servers).
Four files at most (a GPU machine returns 8): the models and the raw files stay in a work folder
outside OUT (`--work`, default a temporary one, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.kit.figures import figures
from benchmarks.kit.plans import PLANS
from benchmarks.kit.process_group import Stopped, run_step, stop_on_sigterm
from benchmarks.kit.record import Kit
from benchmarks.kit.steps import Step, build_steps


def run(args: argparse.Namespace, work: Path) -> int:
    models = work / "models"
    kit = Kit(args, work, models)
    steps = build_steps(args, work, models)
    (work / "tests" / "tests.xml").unlink(missing_ok=True)  # an earlier call's, same --work
    kit.doc["steps"] = [s.record for s in steps]
    for s in steps:
        s.record.update(step=s.name, status="pending")
    kit.write()
    env = {"HF_HUB_OFFLINE": "1", **os.environ, "BEAMLINE_TEST_DEVICE": args.device}
    env["PYTHONUNBUFFERED"] = "1"  # a log cut short by a deadline still has its last lines
    status: dict[str, str] = {}

    def skip(step: Step, why: str) -> None:
        step.record.update(status="skipped", why=why)
        status[step.name] = "skipped"
        kit.write()

    with stop_on_sigterm():
        for i, step in enumerate(steps):
            if step.needs is not None and status.get(step.needs) != "ok":
                skip(step, f"{step.needs!r} did not succeed")
                continue
            left = kit.left()
            weights = sum(
                s.weight for s in steps[i:] if s.needs is None or status.get(s.needs, "ok") == "ok"
            )  # what the later steps that can still run will need
            timeout = min(left, max(step.floor_s, left * step.weight / weights))
            if timeout < 5:
                skip(step, f"out of time ({left:.0f} s left)")
                continue
            step.record.update(status="running", deadline_s=round(timeout))
            step.record["log"] = str(step.log.relative_to(work))
            kit.write()
            started = time.monotonic()
            print(f"[kit] {step.name}: up to {timeout:.0f} s ...", flush=True)
            try:
                rc, status[step.name] = run_step(
                    step.cmd, step.log, env, timeout, step.first_signal
                )
            except (Stopped, KeyboardInterrupt) as exc:
                step.record.update(status="stopped", why=type(exc).__name__)
                step.record["seconds"] = round(time.monotonic() - started, 1)
                step.record["figures"] = figures(step)
                kit.write()
                return 143
            seconds = time.monotonic() - started
            step.record.update(status=status[step.name], rc=rc, seconds=round(seconds, 1))
            step.record["figures"] = figures(step)
            kit.write()
            print(
                f"[kit] {step.name}: {status[step.name]} (rc {rc}) in {seconds:.0f} s, "
                f"{kit.left():.0f} s left",
                flush=True,
            )
    kit.write(complete=True)
    return 0 if all(v == "ok" for v in status.values()) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, the plan's defaults filled in where it leaves them out."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="what comes back: 4 files")
    ap.add_argument("--plan", choices=sorted(PLANS), default="first-contact")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, help="seconds for the whole kit (plan's default)")
    ap.add_argument("--work", type=Path, help="models and raw files (default: a temporary folder)")
    ap.add_argument("--shapes", help="random_models.py shapes, comma list")
    ap.add_argument("--concurrency", help="serving levels, comma list")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument(
        "--rounds", type=int, help="serving: each level c runs rounds x c requests (at least 8)"
    )
    ap.add_argument("--output-tokens", help="MIN,MAX")
    ap.add_argument("--rows", help="engine_overhead row counts")
    ap.add_argument("--steps", type=int, help="engine_overhead timed steps per pair")
    ap.add_argument("--tests", help="comma list of test files / node ids; none or empty: none")
    ap.add_argument("--maxfail", type=int, default=20, help="pytest stops after this many")
    ap.add_argument(
        "--test-timeout", type=int, default=120, help="seconds per test (pytest-timeout)"
    )
    ap.add_argument(
        "--no-compile", action="store_true", help="skip the eager and --torch-compile variants"
    )
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    plan = PLANS[args.plan]
    args.budget = args.budget or plan.budget
    args.shapes = (args.shapes or plan.shapes).split(",")
    args.concurrency = args.concurrency or plan.concurrency
    args.num_requests = args.num_requests or plan.num_requests
    args.rounds = args.rounds or plan.rounds
    args.output_tokens = args.output_tokens or plan.output_tokens
    args.rows = args.rows or plan.rows
    args.steps = args.steps or plan.steps
    tests = plan.tests if args.tests is None else args.tests.split(",")
    args.tests = [t for t in tests if t.strip() and t.strip() != "none"]
    args.variants = plan.variants and not args.no_compile
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        return run(args, args.work)
    with tempfile.TemporaryDirectory(prefix="beamline-kit-") as work:
        return run(args, Path(work))


if __name__ == "__main__":
    sys.exit(main())
