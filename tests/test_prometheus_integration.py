"""A real Prometheus scrapes a real beamline server with the shipped scrape config.

Needs the `prometheus` binary (Debian package `prometheus`); skipped without it. Both processes
listen on 127.0.0.1 only, every wait is bounded, and both are stopped whatever happens.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import yaml

from tests.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus binary not on PATH (apt-get install prometheus)",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 60.0
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_config(target: str) -> str:
    """The shipped configs/prometheus.yml with only its target replaced, scraping every 1 s."""
    config = yaml.safe_load((ROOT / "configs/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [target]}]
    return yaml.safe_dump(config)


class Processes:
    """Started subprocesses, with their logs in files, so a failure can show what they said."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *cmd: str | Path) -> None:
        log = (self.log_dir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_for(what: str, probe: Callable[[], T | None], deadline: float, procs: Processes) -> T:
    """Poll `probe` until it returns a value other than None; fail at `deadline`."""
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            result = probe()
        except httpx.HTTPError:
            result = None
        if result is not None:
            return result
        time.sleep(0.25)
    logs = "\n".join(f"--- {name}\n{procs.log_tail(name)}" for name in procs.procs)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def test_prometheus_scrapes_generation_tokens(tmp_path: Path, processes: Processes) -> None:
    deadline = time.monotonic() + BUDGET_S
    model_dir = build_tiny_model(tmp_path / "model")
    server_port, prom_port = free_port(), free_port()
    server = f"http://127.0.0.1:{server_port}"
    prometheus = f"http://127.0.0.1:{prom_port}"
    processes.start(
        "beamline", sys.executable, "-m", "server.cli", "serve",
        "--model", model_dir, "--host", "127.0.0.1", "--port", str(server_port),
        "--num-kv-blocks", "256",
    )  # fmt: skip
    config = tmp_path / "prometheus.yml"
    config.write_text(scrape_config(f"127.0.0.1:{server_port}"))
    processes.start(
        "prometheus", "prometheus", f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
    )  # fmt: skip

    with httpx.Client(timeout=10) as http:

        def ok(url: str) -> bool | None:
            return http.get(url).status_code == 200 or None

        def query(promql: str) -> list[dict]:
            response = http.get(f"{prometheus}/api/v1/query", params={"query": promql})
            response.raise_for_status()
            return response.json()["data"]["result"]

        def generated_tokens() -> float | None:
            result = query("beamline:generation_tokens_total")
            return float(result[0]["value"][1]) if result else None

        def target_up() -> bool | None:
            targets = http.get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
            return (
                any(t["labels"]["job"] == "beamline" and t["health"] == "up" for t in targets)
                or None
            )

        wait_for("beamline /health", lambda: ok(f"{server}/health"), deadline, processes)
        wait_for("prometheus", lambda: ok(f"{prometheus}/-/ready"), deadline, processes)
        wait_for("the beamline target to be up", target_up, deadline, processes)
        before = wait_for("a first scrape", generated_tokens, deadline, processes)

        model = http.get(f"{server}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 5, "temperature": 0}
        response = http.post(f"{server}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        new_tokens = response.json()["usage"]["completion_tokens"]
        assert new_tokens > 0

        def risen() -> float | None:
            value = generated_tokens()
            return value if value is not None and value > before else None

        after = wait_for("generation_tokens_total to rise", risen, deadline, processes)
        assert after - before == new_tokens
        (series,) = query("beamline:generation_tokens_total")
        assert series["metric"]["model_name"] == model
