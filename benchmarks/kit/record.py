"""What comes back from the GPU machine, rewritten atomically after every step: kit.json, tests.xml,
results.tar.gz and logs.tar.gz."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.kit.process_group import REPO_ROOT

LOG_CAP = 4 * 2**20  # bytes of one log in the archive (its tail): a file comes back <= 16 MiB


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
