"""The GPU kit runs end to end on the CPU at tiny size, so it never rots between GPU sessions; its
steps end their whole process group at a deadline, and what comes back is at most 8 files."""

from __future__ import annotations

import json
import signal
import sys
import tarfile
import time
from pathlib import Path

from benchmarks import gpu_kit
from benchmarks.client import level_requests
from benchmarks.kit.steps import build_steps
from benchmarks.serving.options import resolve_args
from benchmarks.workload import BenchRequest
from tests.reliability_helpers import process_gone


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_first_contact_runs_every_step_goes_on_after_a_failure_and_writes_four_files(
    tmp_path: Path,
) -> None:
    """A shape that cannot be built fails its step and skips the steps that need it; the next
    shape runs: tests, build, engine overhead, serving against HF static batching."""
    out = tmp_path / "kit"
    rc = gpu_kit.main(
        ["--out", str(out), "--device", "cpu", "--shapes", "no-such-shape,tiny"]
        + ["--concurrency", "1,2", "--num-requests", "4", "--output-tokens", "4,8"]
        + ["--rows", "4", "--steps", "3", "--tests", "tests/test_detokenizer.py"]
        + ["--budget", "400", "--work", str(tmp_path / "work")]
    )
    kit = json.loads((out / "kit.json").read_text())
    assert rc == 1, kit  # one step failed
    assert kit["plan"] == "first-contact" and kit["complete"] is True
    steps = {s["step"]: s for s in kit["steps"]}
    assert [(name, s["status"]) for name, s in steps.items()] == [
        ("tests", "ok"),
        ("no-such-shape: build", "failed"),
        ("no-such-shape: engine overhead", "skipped"),
        ("no-such-shape: serve", "skipped"),
        ("tiny: build", "ok"),
        ("tiny: engine overhead", "ok"),
        ("tiny: serve", "ok"),
    ]
    assert steps["tests"]["figures"]["tests"] > 0 and steps["tests"]["figures"]["failures"] == 0
    assert {r["kind"] for r in steps["tiny: engine overhead"]["figures"]} == {
        "greedy",
        "sampled",
        "beam",
    }
    serve = steps["tiny: serve"]["figures"]
    assert serve["complete"] is True and serve["skipped"] == {}
    assert set(serve["systems"]) == {"beamline", "hf-static"}  # the baseline ran in the same run
    assert serve["systems"]["beamline"]["out_tok_s"].keys() == {"1", "2"}

    assert sorted(p.name for p in files_under(out)) == [
        "kit.json",
        "logs.tar.gz",
        "results.tar.gz",
        "tests.xml",
    ]  # <= 8: all a GPU machine returns
    assert 'failures="0"' in (out / "tests.xml").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        results = set(tar.getnames())
        serve_doc = json.load(tar.extractfile("tiny/serve.json"))  # type: ignore[arg-type]
    assert results == {"tiny/overhead.json", "tiny/serve.json", "tiny/serve.png"}
    assert serve_doc["complete"] is True
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = set(tar.getnames())
        build_log = tar.extractfile("no-such-shape/build.log").read().decode()  # type: ignore[union-attr]
    assert {"tests/tests.log", "tiny/serve.log", "tiny/beamline-server.log"} <= logs
    assert "KeyError" in build_log  # why the step failed
    assert kit["archives"] == {"results.tar.gz": sorted(results), "logs.tar.gz": sorted(logs)}
    assert not any(name.endswith(".safetensors") for name in results | logs)  # models stay here


CHILD = """
import pathlib, subprocess, sys, time
folder = pathlib.Path(sys.argv[1])
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(folder / "grandchild").write_text(str(sleeper.pid))
if sys.argv[2] == "exit":
    sys.exit(0)
try:
    time.sleep(600)
except KeyboardInterrupt:
    (folder / "interrupted").write_text("yes")  # pytest writes its report here
    time.sleep(600)
"""


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_step_past_its_deadline_ends_its_whole_process_group(tmp_path: Path) -> None:
    """First SIGINT to the step (pytest's report), then the group: the grandchild (a launched
    server, its engine process) dies with the step, not only the step's own process."""
    cmd = [sys.executable, "-c", CHILD, str(tmp_path), "sleep"]
    started = time.monotonic()
    rc, status = gpu_kit.run_step(
        cmd, tmp_path / "step.log", {}, timeout_s=3.0, first_signal=signal.SIGINT, grace_s=1.0
    )
    assert (rc, status) == (124, "timeout")
    assert time.monotonic() - started < 15
    assert (tmp_path / "interrupted").read_text() == "yes"
    assert _gone(int((tmp_path / "grandchild").read_text()))


def test_what_a_finished_step_leaves_running_is_ended(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", CHILD, str(tmp_path), "exit"]
    assert gpu_kit.run_step(cmd, tmp_path / "step.log", {}, timeout_s=60.0) == (0, "ok")
    assert _gone(int((tmp_path / "grandchild").read_text()))


def test_the_full_plan_serves_rounds_of_each_level_not_the_whole_workload_at_every_level(
    tmp_path: Path,
) -> None:
    """All 256 requests at c = 1 of the eager variant took the whole serving step of an H100 run;
    with 2 rounds each level runs 2 x c of the same requests (at least 8), every system alike."""
    requests = [BenchRequest(i, f"p{i}", 8) for i in range(256)]
    assert [len(level_requests(requests, c, 2)) for c in (1, 16, 64, 256)] == [8, 32, 128, 256]
    assert level_requests(requests, 1, 2) == requests[:8]  # the workload's first ones, in order
    assert len(level_requests(requests, 1, None)) == 256
    args = gpu_kit.parse_args(["--out", str(tmp_path), "--plan", "full", "--shapes", "llama-1b"])
    serve = next(s for s in build_steps(args, tmp_path, tmp_path / "models") if "serve" in s.name)
    assert serve.cmd[serve.cmd.index("--rounds") + 1] == "2"
    parsed = resolve_args(serve.cmd[serve.cmd.index("benchmarks.serve") + 1 :])
    assert parsed.rounds == 2 and parsed.num_requests == 256
    first = gpu_kit.parse_args(["--out", str(tmp_path)])
    assert first.rounds is None  # first contact: its 32 requests at both levels
