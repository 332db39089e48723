"""The benchmarks' server launcher (benchmarks/launch.py): waiting out a busy server, and never
leaving one behind when the wait fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks import launch


def test_waiting_for_the_compiled_step_asks_again_after_a_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Start-up's last work (the grammar tokenizer, the collector's freeze) can keep a 2-core
    server from answering for seconds: one slow answer is not a failed start."""
    answers: list[Any] = [httpx.ReadTimeout("busy"), {"decode_step": "compiling"}]
    answers.append({"decode_step": "compiled"})

    def get(self: httpx.Client, url: str) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(200, json=answer)

    monkeypatch.setattr(httpx.Client, "get", get)
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    launch.wait_compiled("http://127.0.0.1:1", timeout_s=60)
    assert answers == []


def test_a_start_that_fails_with_any_error_stops_its_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stopped: list[object] = []
    proc = object()
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: proc)
    monkeypatch.setattr(launch, "wait_healthy", lambda *a: 1.0)

    def unanswered(*args: object) -> float:
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(launch, "wait_compiled", unanswered)
    monkeypatch.setattr(launch, "stop", stopped.append)
    with pytest.raises(httpx.ConnectError):
        launch.start_beamline(None, tmp_path / "server.log")
    assert stopped == [proc]
