"""The client suite's live server, the clients' venvs, and the record of each client's version.

The run's shared `beamline serve` of the default model (tests/server_pool.py: started as users
start it, on a free loopback port) serves every test of this package; its log is kept
(BEAMLINE_TEST_ARTIFACTS/servers) and its tail is attached to any failing test's report. Clients
whose pins fight ours run in their own venv (tests/client_venv.sh), passed in as
BEAMLINE_<CLIENT>_PYTHON; without it their test skips, except under CI=true where it fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server_pool import PooledServer

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Clients the suite has run, with their versions: each test's report carries them to pytest's
# summary (tests/conftest.py).
CLIENT_VERSIONS: dict[str, str] = {}


# The live server while it runs: a failing test's report gets its log's tail.
LIVE: list[PooledServer] = []


@pytest.fixture(scope="package")
def served(default_server: PooledServer) -> Iterator[PooledServer]:
    """The run's shared `beamline serve` of the default model (tests/server_pool.py)."""
    LIVE.append(default_server)
    try:
        yield default_server
    finally:
        LIVE.remove(default_server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test of the live server shows the server log's last lines beside its output;
    every report carries the client versions seen so far (to the summary, across xdist
    workers)."""
    outcome = yield
    report = outcome.get_result()
    if CLIENT_VERSIONS:
        report.user_properties.append(("client_versions", dict(CLIENT_VERSIONS)))
    if report.failed and LIVE and item.get_closest_marker("default_model") is not None:
        log = LIVE[-1].log
        lines = [x for x in log.read_text(errors="replace").splitlines() if "GET /health" not in x]
        report.sections.append((f"server log ({log}), last lines", "\n".join(lines[-40:])))


def record_version(name: str, version: str) -> None:
    """Note a client's version for pytest's summary (and the test's own output)."""
    CLIENT_VERSIONS[name] = version
    print(f"{name} {version}")


def client_python(client: str) -> str:
    """The venv python of `client` from BEAMLINE_<CLIENT>_PYTHON; skip (fail under CI) if unset."""
    var = f"BEAMLINE_{client.upper()}_PYTHON"
    python = os.environ.get(var)
    if not python:
        why = (
            f"{var} is not set; build the venv with "
            f'{var}="$(bash tests/client_venv.sh {client})" (tests/clients/conftest.py)'
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    # Set but broken fails everywhere: whoever set it meant the test to run.
    if shutil.which(python) is None:
        pytest.fail(f"{var}={python} is not an executable; rebuild it with tests/client_venv.sh")
    return python


def run_client_script(
    python: str, script: str, served: PooledServer, timeout_s: float = 600
) -> dict[str, Any]:
    """Run scripts/<script> under a client's venv against the server; its JSON report.

    Each script prints one JSON object on its last stdout line: {"versions": {...},
    "cases": {name: {"ok": true, ...what the user got} | {"ok": false, "error": ...}}}.
    """
    env = {
        **os.environ,
        "PYTHONPATH": "",  # the venv's packages only, never this checkout's
        "HF_HUB_OFFLINE": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    cmd = [python, str(SCRIPTS / script), f"{served.url}/v1", served.model]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    took = time.monotonic() - start
    assert done.returncode == 0 and done.stdout.strip(), (
        f"{script} exited {done.returncode} after {took:.0f} s\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, version in report["versions"].items():
        record_version(name, version)
    print(f"{script}: {took:.1f} s; stderr tail:\n{done.stderr[-1500:]}")
    return report


def case(report: dict[str, Any], name: str) -> dict[str, Any]:
    """One case of a script's report; fails with the client's own error if it raised."""
    result = report["cases"][name]
    if not result["ok"]:
        pytest.fail(f"{name}: the client raised\n{result['error']}", pytrace=False)
    return result
