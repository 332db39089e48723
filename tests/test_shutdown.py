"""SIGTERM on the real CLI: /ready and new requests answer 503 (`draining`), in-flight requests
(streaming and not) run to their last token, then the process exits 0. With the engine in a
process of its own too: that process ignores the signals a terminal or systemd sends to every
process (the drain is the front end's), and ends with the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.live_server import free_port
from tests.reliability_helpers import assert_openai_error, follower_pids, process_gone, sse_payloads
from tests.tiny_models import build_tiny_model

REPO = Path(__file__).resolve().parents[1]
# a first start compiles the CPU default's decode step (two graphs; under TP each rank its own,
# a core each): minutes on a 2-core machine whose other worker runs too, seconds once cached
STARTUP_S = 360
# The in-flight requests must outlast the drain checks by a wide margin: 4 rows of 1,000 tokens
# take seconds on one thread, the checks tens of milliseconds.
IN_FLIGHT_TOKENS = 1000
# two ranks step slower (a broadcast, the sums over the ranks): fewer tokens last as long
IN_FLIGHT_TOKENS_TWO_RANKS = 500
CONTEXT = 4096
DRAIN_TIMEOUT_S = 90


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    tokens: int = IN_FLIGHT_TOKENS  # of each in-flight request


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"server exited with {proc.returncode} while starting:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"server not healthy after {STARTUP_S}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long_llama") / "llama"
    return build_tiny_model(path, "llama", max_position_embeddings=CONTEXT)


@pytest.fixture(params=["off", "on", "tp2"], ids=["engine-thread", "engine-process", "two-ranks"])
def served(
    long_llama_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Served]:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--model",
        str(long_llama_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-kv-blocks",
        str(4 * CONTEXT // 16 + 64),
        "--drain-timeout",
        str(DRAIN_TIMEOUT_S),
        "--num-threads",
        "1",
        "--engine-process",
        "off" if request.param == "off" else "on",
        *(["--tensor-parallel-size", "2"] if request.param == "tp2" else []),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log)
        tokens = IN_FLIGHT_TOKENS_TWO_RANKS if request.param == "tp2" else IN_FLIGHT_TOKENS
        yield Served(proc, url, log, tokens)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


BODY = {
    "prompt": "Once upon a time",
    "max_tokens": IN_FLIGHT_TOKENS,
    "ignore_eos": True,
    "temperature": 0,
}


def streamed_request(url: str, started: threading.Event, tokens: int) -> int:
    """Stream a long completion; set `started` at the first event; return its completion tokens."""
    body = {**BODY, "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DRAIN_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        text = ""
        for chunk in r.iter_text():
            text += chunk
            started.set()
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]", payloads[-3:]
    return json.loads(payloads[-2])["usage"]["completion_tokens"]


def plain_request(url: str, tokens: int) -> int:
    r = httpx.post(
        f"{url}/v1/completions", json={**BODY, "max_tokens": tokens}, timeout=DRAIN_TIMEOUT_S
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


def engine_process_pid(log: str) -> int | None:
    match = re.search(r"engine process (\d+) ready", log)
    return int(match.group(1)) if match else None


def wait_in_flight(url: str, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/v1/engine/stats", timeout=5).json()["num_requests_running"] < count:
        assert time.monotonic() < deadline, "the in-flight requests never started"
        time.sleep(0.01)


def wait_draining(url: str, timeout: float = 5) -> httpx.Response:
    """/ready once it answers 503, polled so the checks start as soon as the drain does."""
    deadline = time.monotonic() + timeout
    while True:
        ready = httpx.get(f"{url}/ready", timeout=5)
        if ready.status_code == 503 or time.monotonic() > deadline:
            return ready
        time.sleep(0.01)


@pytest.mark.timeout(300)
def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(served: Served) -> None:
    url = served.url
    assert "torch intra-op threads: 1" in served.log.read_text()  # --num-threads reached torch
    engine_pid = engine_process_pid(served.log.read_text())
    assert (engine_pid is not None) == ("--engine-process on" in " ".join(served.proc.args))
    ranks = follower_pids(engine_pid) if engine_pid is not None else []
    assert len(ranks) == int("--tensor-parallel-size 2" in " ".join(served.proc.args))
    with ThreadPoolExecutor(max_workers=4) as pool:
        started = [threading.Event() for _ in range(3)]
        streams: list[Future[int]] = [
            pool.submit(streamed_request, url, ev, served.tokens) for ev in started
        ]
        plain = pool.submit(plain_request, url, served.tokens)
        for ev in started:
            assert ev.wait(60), "a stream never started"
        wait_in_flight(url, 4)

        served.proc.send_signal(signal.SIGTERM)
        t_sigterm = time.monotonic()
        if engine_pid is not None:  # as Ctrl-C or systemd would: the engine must keep going
            os.kill(engine_pid, signal.SIGINT)
            os.kill(engine_pid, signal.SIGTERM)
        ready = wait_draining(url)  # the handler runs on the server's event loop
        assert_openai_error(ready, 503, code="draining")
        refused = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=5
        )
        assert_openai_error(refused, 503, code="draining")
        assert refused.headers.get("retry-after")
        refused_chat = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=5,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        )
        assert_openai_error(refused_chat, 503, code="draining")
        assert served.proc.poll() is None, (
            "the server exited before its in-flight requests finished"
        )

        # Every in-flight request runs to its last token.
        assert [f.result(timeout=DRAIN_TIMEOUT_S + 30) for f in streams] == [served.tokens] * 3
        assert plain.result(timeout=DRAIN_TIMEOUT_S + 30) == served.tokens

    returncode = served.proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
    log = served.log.read_text()
    assert returncode == 0, log[-3000:]
    assert time.monotonic() - t_sigterm < DRAIN_TIMEOUT_S, (
        "the drain waited for its timeout, not the requests"
    )
    assert "Traceback" not in log, log[-3000:]
    if engine_pid is not None:
        deadline = time.monotonic() + 10
        while not all(process_gone(pid) for pid in [engine_pid, *ranks]):
            assert time.monotonic() < deadline, "the engine process or a rank outlived the server"
            time.sleep(0.05)
