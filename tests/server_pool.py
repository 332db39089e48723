"""Live `beamline serve` processes shared by the whole test run, across pytest-xdist workers.

Tests that only need a live server over HTTP ask the pool for one instead of starting their own:
`pooled_server("default")` is the default model as `beamline serve` serves it (the CPU default),
`pooled_server("tiny")` a tiny random Gemma 3 served under the default model's name. The first
test that asks starts the server, every later test in any worker gets the same one, and the
process that began the run (xdist's controller, else pytest itself) stops them all at its end.
Process-level tests (drain, dead ranks, start-up, the CLI's exits) keep their own processes.

How workers agree: the controller makes a folder (its path in BEAMLINE_TEST_SERVER_POOL, which
the workers inherit); a server's start runs under a lock file there and leaves a JSON record
(address, pid, log) that the other workers read. A failed start leaves its error instead, so
every test that needs that server fails with the same message rather than starting it again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from benchmarks.launch import first_model_id, start_beamline

POOL_VAR = "BEAMLINE_TEST_SERVER_POOL"
START_TIMEOUT_S = 900  # a cold start of the default model compiles its decode step first
# A grammar compile may take longer than the 10 s default on a loaded 2-core machine: a client's
# first structured request would then be a 400 grammar_too_complex, not a defect.
GRAMMAR_TIMEOUT = ["--grammar-compile-timeout", "60"]


@dataclass(frozen=True)
class PooledServer:
    """A live server: base URL (no /v1), the served model id, its log and model folder."""

    url: str
    model: str
    log: Path
    model_dir: Path


def open_pool() -> Path | None:
    """Make the pool's folder unless this process inherited one; the folder if it is ours."""
    if os.environ.get(POOL_VAR):
        return None
    folder = Path(tempfile.mkdtemp(prefix="beamline-server-pool-"))
    os.environ[POOL_VAR] = str(folder)
    return folder


def close_pool(folder: Path) -> None:
    """Stop every server the run started (SIGTERM to its process group, then SIGKILL)."""
    for pid_file in folder.glob("*.pid"):
        stop_group(int(pid_file.read_text()))
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(POOL_VAR, None)


def stop_group(pid: int, grace_s: float = 30.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:  # reap it where it is our child (no xdist); a worker's orphan is init's to reap
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                break
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    with suppress(ProcessLookupError):  # ranks or an engine process left in its group
        os.killpg(pid, signal.SIGKILL)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def log_folder(pool: Path) -> Path:
    """Server logs: BEAMLINE_TEST_ARTIFACTS/servers when set (kept after the run), else the
    pool's folder."""
    root = os.environ.get("BEAMLINE_TEST_ARTIFACTS")
    folder = Path(root) / "servers" if root else pool
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _what_to_serve(name: str, pool: Path) -> tuple[str | None, list[str], Path]:
    """(--model, other flags, model folder) of the pool's server `name`."""
    if name == "default":
        from server.model.loader import resolve_model_dir

        return None, GRAMMAR_TIMEOUT, resolve_model_dir(None)
    if name == "tiny":
        from tests.tiny_models import build_tiny_model

        model = build_tiny_model(pool / "tiny-gemma3", "gemma3")
        return str(model), ["--served-model-name", "gemma-3-270m", *GRAMMAR_TIMEOUT], model
    raise ValueError(f"no pooled server named {name!r}")


def _start(name: str, pool: Path) -> PooledServer:
    model, flags, model_dir = _what_to_serve(name, pool)
    log = log_folder(pool) / f"{name}-server.log"
    proc, url, ready_s = start_beamline(model, log, flags, START_TIMEOUT_S, own_session=True)
    (pool / f"{name}.pid").write_text(str(proc.pid))
    print(f"\npooled server {name!r}: healthy in {ready_s:.0f} s at {url} (log: {log})")
    return PooledServer(url, first_model_id(url), log, model_dir)


_MINE: dict[str, PooledServer] = {}


def pooled_server(name: str) -> PooledServer:
    """The run's server `name` ("default" or "tiny"), started by whoever asks first."""
    if name in _MINE:
        return _MINE[name]
    folder = os.environ.get(POOL_VAR)
    if not folder:
        raise RuntimeError(f"{POOL_VAR} is unset: tests/conftest.py opens the pool")
    pool = Path(folder)
    record = pool / f"{name}.json"
    with _locked(pool / f"{name}.lock"):
        if not record.exists():
            try:
                server = _start(name, pool)
            except Exception as exc:  # every later asker fails with this, none starts again
                record.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
                raise
            record.write_text(json.dumps(asdict(server), default=str))
        data = json.loads(record.read_text())
    if "error" in data:
        pytest.fail(f"the pooled {name!r} server failed to start:\n{data['error']}", pytrace=False)
    server = PooledServer(data["url"], data["model"], Path(data["log"]), Path(data["model_dir"]))
    _MINE[name] = server
    return server
