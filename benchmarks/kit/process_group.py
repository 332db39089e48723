"""One step in a process group of its own: its deadline, or SIGTERM to the kit, ends the whole
group (a launched server and its engine process too), and what a step leaves behind is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 15.0  # between SIGTERM and SIGKILL of a step's group


class Stopped(Exception):
    """The kit itself was asked to stop (SIGTERM)."""


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
