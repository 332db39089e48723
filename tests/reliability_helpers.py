"""Shared helpers of the reliability tests: OpenAI error shape, engine stats, idle waits, metrics.

Works with an async client (ASGI app or live uvicorn) and with a sync client (live uvicorn in
threads, subprocess servers).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx

from server.api.app import create_app
from server.api.serving import ServingContext

# A fixed greedy request whose text must never change while a test throws garbage at the server.
PROBE: dict[str, Any] = {
    "prompt": "The quick brown fox",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}

ERROR_KEYS = {"message", "type", "param", "code"}


def param_matches(actual: str | None, expected: str) -> bool:
    """`expected` names the field: exactly, or as the head of a nested path (`prompt.0`)."""
    return actual is not None and (actual == expected or actual.startswith(expected + "."))


def check_error_shape(response: httpx.Response) -> dict[str, Any]:
    """The body is OpenAI's `{"error": {"message", "type", "param", "code"}}`; returns the inner
    dict."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AssertionError(
            f"error body is not JSON: {response.status_code} {response.text[:300]!r}"
        ) from exc
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


def assert_openai_error(
    response: httpx.Response,
    status: int | Collection[int],
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    statuses = (status,) if isinstance(status, int) else tuple(status)
    assert response.status_code in statuses, (response.status_code, response.text[:500])
    err = check_error_shape(response)
    if param is not None:
        assert param_matches(err["param"], param), (param, err)
    if code is not None:
        assert err["code"] == code, (code, err)
    return err


async def assert_engine_dead(client: httpx.AsyncClient) -> None:
    """A server whose engine is gone: /health and a completion both answer 503 engine_dead."""
    assert_openai_error(await client.get("/health"), 503, code="engine_dead")
    refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert_openai_error(refused, 503, code="engine_dead")


async def post_to(ctx: ServingContext, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` as JSON to a fresh app over `ctx` (in process, no port)."""
    transport = httpx.ASGITransport(app=create_app(ctx=ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body, timeout=120)


def is_idle(stats: dict[str, Any]) -> bool:
    """Nothing running, queued or admitted, and every KV block back in the pool."""
    return (
        stats["num_requests_running"] == 0
        and stats["num_requests_waiting"] == 0
        and stats["num_requests_in_flight"] == 0
        and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    )


async def engine_stats(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.get("/v1/engine/stats")
    assert r.status_code == 200, r.text
    return r.json()


def engine_stats_sync(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/v1/engine/stats")
    assert r.status_code == 200, r.text
    return r.json()


async def wait_until_idle(client: httpx.AsyncClient, timeout: float = 2.0) -> dict[str, Any]:
    """Poll the engine stats until idle; fail with the last stats after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine_stats(client)
        if is_idle(stats) or time.monotonic() > deadline:
            assert is_idle(stats), f"not idle {timeout}s later: {stats}"
            return stats
        await asyncio.sleep(0.02)


def wait_until_idle_sync(client: httpx.Client, timeout: float = 2.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats_sync(client)
        if is_idle(stats) or time.monotonic() > deadline:
            assert is_idle(stats), f"not idle {timeout}s later: {stats}"
            return stats
        time.sleep(0.02)


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$"
)


def metric_sum(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of every sample of `name` whose labels include `labels` (Prometheus text format)."""
    total = 0.0
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


def aborted_total(metrics_text: str) -> float:
    return metric_sum(metrics_text, "beamline:request_failure_total", reason="aborted")


def completion_text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def sse_payloads(body: str) -> list[str]:
    """The `data:` payloads of a complete SSE body, `[DONE]` included."""
    assert body.endswith("\n\n"), body[-200:]
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events[:3]
    return [e[len("data: ") :] for e in events]


def process_gone(pid: int) -> bool:
    """No process `pid` any more, or only its zombie (its parent has not reaped it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def follower_pids(engine_pid: int) -> list[int]:
    """The tensor-parallel ranks the engine process started (its spawned children)."""
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    return [
        int(pid)
        for pid in children
        if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    ]
