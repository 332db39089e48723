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
  time at 16, 64 and 256 rows, serving at c = 1, 16, 64, 256 (256 requests): the default, plain
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
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Tests that run models or kernels (each through tests/conftest.py's device switch).
KIT_TESTS = (
    "tests/test_triton_attention.py",
    "tests/test_triton_compile.py",
    "tests/test_cuda_graphs.py",
    "tests/test_overlap_outputs.py",
    "tests/test_async_scheduling.py",
    "tests/test_host_syncs.py",
    "tests/test_engine_process.py",
    "tests/test_speculation.py",
    "tests/test_engine_correctness.py",
    "tests/test_decoding_hf_parity.py",
    "tests/test_strategies.py",
    "tests/test_batch_invariance.py",
    "tests/test_prompt_logprobs.py",
    "tests/test_engine_behaviour.py",
    "tests/test_prefix_cache.py",
    "tests/test_overload_and_preemption.py",
    "tests/test_beam_logprobs.py",
    "tests/test_api.py",
)
# What CUDA changes most, most important first (a failure budget or the deadline may cut the rest):
# the kernel, the graphs, async scheduling and its one read per step, the engine process with
# CUDA's defaults, then token parity with HF generate() (greedy; beams).
FIRST_CONTACT_TESTS = (
    "tests/test_triton_attention.py",
    "tests/test_triton_compile.py::test_serving_after_warm_up_compiles_no_new_kernel_variant",
    "tests/test_triton_compile.py::test_queries_split_across_programs_match_the_reference",
    "tests/test_cuda_graphs.py",
    "tests/test_async_scheduling.py",
    "tests/test_host_syncs.py",
    "tests/test_engine_process.py",
    "tests/test_engine_correctness.py",
    "tests/test_strategies.py::test_beam_search_in_the_engine_equals_hf_generate",
)
EAGER = "--no-cuda-graphs --overlap-outputs off --async-scheduling off"
LOG_CAP = 4 * 2**20  # bytes of one log in the archive (its tail): a file comes back <= 16 MiB
GRACE_S = 15.0  # between SIGTERM and SIGKILL of a step's group


@dataclass(frozen=True)
class Plan:
    tests: tuple[str, ...]
    shapes: str
    concurrency: str
    num_requests: int
    output_tokens: str
    rows: str
    steps: int  # engine_overhead's timed steps per pair
    variants: bool  # eager and --torch-compile beside the default
    budget: float  # seconds for the whole kit


PLANS = {
    "first-contact": Plan(
        tests=FIRST_CONTACT_TESTS,
        shapes="llama-1b",
        concurrency="1,16",
        num_requests=32,
        output_tokens="32,128",
        rows="16,64",
        steps=20,
        variants=False,
        budget=360.0,
    ),
    "full": Plan(
        tests=KIT_TESTS,
        shapes="llama-1b,llama-8b",
        concurrency="1,16,64,256",
        num_requests=256,
        output_tokens="32,128",
        rows="16,64,256",
        steps=20,
        variants=True,
        budget=510.0,  # + the grace of a last deadline: within a 10-minute command
    ),
}


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


class Stopped(Exception):
    """The kit itself was asked to stop (SIGTERM)."""


# ---- running a step in its own process group -----------------------------------------------------
def _exited(pid: int) -> bool:
    """Whether `pid` exited, without reaping it: its id, the group's, stays taken meanwhile."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def end_group(
    proc: subprocess.Popen, first: signal.Signals | None = None, grace_s: float = GRACE_S
) -> None:
    """End the step's whole group: `first` to the step's own process (pytest writes its report on
    SIGINT), then SIGTERM to the group (a launched server drains), SIGKILL `grace_s` later."""
    pgid = proc.pid
    if first is not None and not _exited(pgid):
        os.kill(pgid, first)
        _wait(lambda: _exited(pgid), grace_s)
    _signal_group(pgid, signal.SIGTERM)
    _wait(lambda: not group_members(pgid), grace_s)
    _signal_group(pgid, signal.SIGKILL)
    _wait(lambda: not group_members(pgid), 5.0)


def _wait(done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)


def run_step(
    cmd: list[str],
    log: Path,
    env: dict[str, str],
    timeout_s: float,
    first_signal: signal.Signals | None = None,
    grace_s: float = GRACE_S,
) -> tuple[int, str]:
    """Run `cmd` (output in `log`) in a new session; (exit code, status): ok, failed, or timeout
    (exit code 124) once `timeout_s` passed and the whole group was ended. Processes the step left
    behind are killed either way: on a GPU they would hold its memory."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,  # a group of its own: a deadline ends all of it
        )
    deadline = time.monotonic() + timeout_s
    try:
        while not _exited(proc.pid):
            if time.monotonic() > deadline:
                end_group(proc, first_signal, grace_s)
                proc.wait()
                return 124, "timeout"
            time.sleep(0.2)
    except BaseException:  # the kit is stopping: its step must not outlive it
        end_group(proc, grace_s=grace_s)
        proc.wait()
        raise
    _signal_group(proc.pid, signal.SIGKILL)  # leftovers (the leader is a zombie: id still taken)
    rc = proc.wait()
    return rc, "ok" if rc == 0 else "failed"


# ---- headline figures ----------------------------------------------------------------------------
def summarize_tests(xml: Path, log: Path) -> dict:
    """Counts and failures from the JUnit report, or from pytest's -v lines if it has none."""
    failed: list[str] = []
    if xml.exists():
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        counts = {
            key: sum(int(s.get(key, 0)) for s in suites)
            for key in ("tests", "failures", "errors", "skipped")
        }
        for case in root.iter("testcase"):
            for bad in case:
                if bad.tag in ("failure", "error"):
                    message = (bad.get("message") or "").strip().split("\n")[0][:300]
                    failed.append(f"{case.get('classname')}::{case.get('name')}: {message}")
        return {**counts, "failed": failed[:50], "source": "tests.xml"}
    outcomes: dict[str, int] = {}
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for parts in (line.split() for line in lines):
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in PYTEST_OUTCOMES:
            outcomes[parts[1].lower()] = outcomes.get(parts[1].lower(), 0) + 1
            if parts[1] in ("FAILED", "ERROR"):
                failed.append(parts[0])
    return {**outcomes, "failed": failed[:50], "source": "tests.log (no report: cut short)"}


PYTEST_OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


# engine_overhead's headline: host ms per step, and what a step costs against its forward
OVERHEAD_KEYS = "kind rows path host_ms forward_ms step_ms free_step_ms step_per_forward".split()


def summarize_overhead(path: Path) -> list[dict]:
    return [
        {k: round(row[k], 3) if isinstance(row[k], float) else row[k] for k in OVERHEAD_KEYS}
        for row in json.loads(path.read_text())
    ]


def summarize_serve(path: Path) -> dict:
    doc = json.loads(path.read_text())
    per_system: dict[str, dict] = {}
    for name, system in doc["systems"].items():
        runs = {f"{run['x']:g}": run["metrics"] for run in system["runs"]}
        per_system[name] = {
            "out_tok_s": {x: round(m["output_throughput"], 1) for x, m in runs.items()},
            "ttft_p50_ms": {x: _round(m["ttft_ms"]["p50"]) for x, m in runs.items()},
            "tpot_p50_ms": {x: _round(m["tpot_ms"]["p50"]) for x, m in runs.items()},
            "errors": sum(m["errors"] for m in runs.values()),
        }
    return {
        "complete": doc.get("complete"),
        "systems": per_system,
        "skipped": {k: v.splitlines()[0][:300] for k, v in doc["skipped"].items()},
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def figures(step: Step) -> object:
    try:
        if step.name == "tests":
            return summarize_tests(step.log.with_name("tests.xml"), step.log)
        if step.result is None or not step.result.exists():
            return None
        if step.name.endswith("engine overhead"):
            return summarize_overhead(step.result)
        return summarize_serve(step.result)
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


# ---- what goes back ------------------------------------------------------------------------------
def _atomic(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def write_archive(path: Path, files: list[tuple[Path, str]]) -> list[str]:
    """A .tar.gz of `files` (source, name inside), each log cut to its last LOG_CAP bytes;
    written beside `path` and renamed over it."""
    tmp = _atomic(path)
    with tarfile.open(tmp, "w:gz") as tar:
        for src, name in files:
            size = src.stat().st_size
            if size <= LOG_CAP:
                tar.add(src, name)
                continue
            with src.open("rb") as f:
                f.seek(size - LOG_CAP)
                data = f"[first {size - LOG_CAP} bytes cut]\n".encode() + f.read()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(src.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return [name for _, name in files]


def collect(work: Path, models: Path) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(results, logs) under `work`, the models' folder left out."""
    results, logs = [], []
    for path in sorted(work.rglob("*")):
        if models in path.parents or not path.is_file() or path.name.startswith("."):
            continue
        name = str(path.relative_to(work))
        if path.suffix == ".log":
            logs.append((path, name))
        elif path.suffix in (".json", ".png"):  # tests.xml goes back as a file of its own
            results.append((path, name))
    return results, logs


def machine() -> dict:
    """Versions and the GPU, without importing torch here (the kit holds no device memory)."""
    info: dict[str, object] = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "triton", "fastapi", "pydantic", "llguidance"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    query = "--query-gpu=name,memory.total,driver_version"
    for key, cmd in (
        ("gpu", ["nvidia-smi", query, "--format=csv,noheader"]),
        ("commit", ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"]),
    ):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            info[key] = done.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info[key] = None
    return info


class Kit:
    """The run's record, written to OUT (kit.json, tests.xml, two archives) after every step."""

    def __init__(self, args: argparse.Namespace, work: Path, models: Path) -> None:
        self.args = args
        self.out: Path = args.out
        self.work = work
        self.models = models
        self.started = time.monotonic()
        self.doc: dict = {
            "kit": "beamline GPU kit (benchmarks/gpu_kit.py)",
            "plan": args.plan,
            "device": args.device,
            "dtype": args.dtype,
            "budget_s": args.budget,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "argv": args.argv,
            "machine": machine(),
            "complete": False,
            "elapsed_s": 0.0,
            "how_to_read": "steps in order; status ok | failed (rc) | timeout (its deadline "
            "ended its process group) | skipped (why) | running (the run was cut here) | "
            "stopped; figures: the step's headline numbers (tests: counts and failures; "
            "engine overhead: host ms per step at each kind and row count; serve: out tok/s, "
            "TTFT and TPOT p50 per system and concurrency); the JSON and plots in "
            "results.tar.gz, every log in logs.tar.gz (names in `archives`)",
            "steps": [],
            "archives": {},
        }

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.started)

    def write(self, complete: bool = False) -> None:
        self.doc["complete"] = complete
        self.doc["elapsed_s"] = round(time.monotonic() - self.started, 1)
        results, logs = collect(self.work, self.models)
        self.doc["archives"] = {
            "results.tar.gz": write_archive(self.out / "results.tar.gz", results),
            "logs.tar.gz": write_archive(self.out / "logs.tar.gz", logs),
        }
        report = self.work / "tests" / "tests.xml"
        if self.args.tests and report.exists():
            shutil.copyfile(report, _atomic(self.out / "tests.xml"))
            os.replace(_atomic(self.out / "tests.xml"), self.out / "tests.xml")
        _atomic(self.out / "kit.json").write_text(json.dumps(self.doc, indent=2) + "\n")
        os.replace(_atomic(self.out / "kit.json"), self.out / "kit.json")


# ---- the plan's steps ----------------------------------------------------------------------------
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


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises Stopped (the running step's group is ended, the files written)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="what comes back: 4 files")
    ap.add_argument("--plan", choices=sorted(PLANS), default="first-contact")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, help="seconds for the whole kit (plan's default)")
    ap.add_argument("--work", type=Path, help="models and raw files (default: a temporary folder)")
    ap.add_argument("--shapes", help="random_models.py shapes, comma list")
    ap.add_argument("--concurrency", help="serving levels, comma list")
    ap.add_argument("--num-requests", type=int)
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
    args.output_tokens = args.output_tokens or plan.output_tokens
    args.rows = args.rows or plan.rows
    args.steps = args.steps or plan.steps
    tests = plan.tests if args.tests is None else args.tests.split(",")
    args.tests = [t for t in tests if t.strip() and t.strip() != "none"]
    args.variants = plan.variants and not args.no_compile
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        return run(args, args.work)
    with tempfile.TemporaryDirectory(prefix="beamline-kit-") as work:
        return run(args, Path(work))


if __name__ == "__main__":
    sys.exit(main())
