"""The run's server pool (tests/server_pool.py): one start per server for every asker, a failed
start fails every later asker without a second start, and closing the pool stops what it
started, child processes included."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import server_pool
from tests.server_pool import POOL_VAR, PooledServer, close_pool, pooled_server


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(POOL_VAR, str(tmp_path))
    monkeypatch.setattr(server_pool, "_MINE", {})
    return tmp_path


def test_a_server_starts_once_and_every_asker_gets_its_record(
    pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[str] = []

    def fake_start(name: str, folder: Path) -> PooledServer:
        starts.append(name)
        return PooledServer("http://127.0.0.1:1", "m", folder / "log", folder)

    monkeypatch.setattr(server_pool, "_start", fake_start)
    first = pooled_server("tiny")
    monkeypatch.setattr(server_pool, "_MINE", {})  # as another worker: only the record is shared
    assert pooled_server("tiny") == first and starts == ["tiny"]


def test_a_failed_start_fails_every_later_asker_without_starting_again(
    pool: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[str] = []

    def failing_start(name: str, folder: Path) -> PooledServer:
        starts.append(name)
        raise RuntimeError("the model failed to load")

    monkeypatch.setattr(server_pool, "_start", failing_start)
    with pytest.raises(RuntimeError):
        pooled_server("default")
    with pytest.raises(pytest.fail.Exception, match="the model failed to load"):
        pooled_server("default")
    assert starts == ["default"]


def test_closing_the_pool_stops_a_server_and_its_children(pool: Path) -> None:
    # a "server" in its own session with a child, as `beamline serve` with ranks would be
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(flush=True)\n"
        "time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline()  # the child exists
    (pool / "default.pid").write_text(str(proc.pid))
    close_pool(pool)
    assert proc.wait(timeout=10) is not None
    for _ in range(50):  # SIGKILL lands asynchronously: on a busy host, a moment after killpg
        group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
        alive = [pid for pid in group.stdout.split() if not zombie(int(pid))]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == [], "a child of the server outlived the pool"
    assert not pool.exists()


def zombie(pid: int) -> bool:
    """Ended but not reaped yet (an orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone already
