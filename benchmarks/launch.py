"""Start `beamline serve` on a free loopback port for the length of a benchmark, then stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


class LaunchError(RuntimeError):
    """The server exited or never became healthy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def beamline_command(port: int, model: str | None, extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m server.cli serve ...` (the same as the `beamline serve` console script)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    return cmd + list(extra_args)


def _error_message(response: httpx.Response) -> str:
    """The OpenAI-shaped error message of a response, or ''."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    """Poll GET /health until 200; return the seconds it took. Fails early if `proc` exits."""
    start = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise LaunchError(
                    f"server exited with code {proc.returncode} before becoming healthy"
                )
            try:
                response = client.get(base_url + "/health")
                if response.status_code == 200:
                    return time.monotonic() - start
                message = _error_message(response)
                if message.startswith("model failed to load"):  # no point waiting any longer
                    raise LaunchError(message)
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout_s:
                raise LaunchError(f"{base_url}/health not 200 after {timeout_s:.0f} s")
            time.sleep(0.5)


def wait_compiled(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> float:
    """Poll GET /v1/engine/stats while its `decode_step` says "compiling" (a server answers with
    the eager step until the compiled one takes over: a benchmark measures the latter); return
    the seconds it took. A server that does not say (another version, a key needed) is not
    waited for."""
    start = time.monotonic()
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise LaunchError(f"server exited with code {proc.returncode} while compiling")
            try:
                response = client.get(base_url + "/v1/engine/stats")
            except httpx.TimeoutException:  # a server busy with start-up's last work: ask again
                response = None
            if response is not None and (
                response.status_code != 200 or response.json().get("decode_step") != "compiling"
            ):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise LaunchError(f"{base_url}: still compiling after {timeout_s:.0f} s")
            time.sleep(0.5)


def first_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first id of GET /v1/models: what to put in the `model` field by default."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0, headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise LaunchError(f"{base_url}/v1/models lists no model; pass --model-name")
    return str(data[0]["id"])


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL after `grace_s` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # beamline drains in-flight requests and exits 0
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def launched_command(
    cmd: Sequence[str],
    port: int,
    log_path: Path,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """Start any OpenAI-compatible server's `cmd` (listening on loopback `port`), output to
    `log_path`; yield its base URL once GET /health answers 200; stop it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"launching: {' '.join(cmd)}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", timeout_s, proc)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


def start_beamline(
    model: str | None,
    log_path: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    own_session: bool = False,
    compiled: bool = True,
) -> tuple[subprocess.Popen, str, float]:
    """Start `beamline serve` on a free loopback port, output to `log_path`, and wait for its
    /health: (process, base URL, seconds to healthy). A start that fails is stopped and raises
    LaunchError with the log's last lines. `own_session`: the server leads a process group of its
    own (what it starts, ranks or an engine process, can be stopped with it). `compiled`: return
    once the compiled decode step, if any, is in use (a server compiling beside serving
    answers with the eager step until then)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = beamline_command(port, model, extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"launching: {' '.join(cmd)}  (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=own_session,
        )
    try:
        ready = wait_healthy(base_url, timeout_s, proc)
        if compiled:
            wait_compiled(base_url, timeout_s, proc)
    except LaunchError as exc:
        stop(proc)
        raise LaunchError(f"{exc}\n--- last lines of {log_path} ---\n{_tail(log_path)}") from None
    except BaseException:  # anything else (an interrupt, a client error): no server left behind
        stop(proc)
        raise
    return proc, base_url, ready


@contextmanager
def launched_beamline(
    model: str | None,
    log_path: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    compiled: bool = True,
) -> Iterator[tuple[str, float]]:
    """Yield (base_url, seconds to healthy) of a fresh beamline server; output to `log_path`.
    `compiled`: as start_beamline's."""
    proc, base_url, ready = start_beamline(
        model, log_path, extra_args, timeout_s, compiled=compiled
    )
    try:
        yield base_url, ready
    finally:
        stop(proc)
