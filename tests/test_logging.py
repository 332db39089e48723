"""Request ids and structured logs."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from server.logs import JsonFormatter


async def test_request_id_is_returned_and_logged_per_finished_request(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    r = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"X-Request-Id": "trace-123"},
    )
    assert r.headers["x-request-id"] == "trace-123"
    finished = [
        rec
        for rec in caplog.records
        if rec.name == "server.engine.engine" and "finished" in rec.message
    ]
    assert len(finished) == 1
    rec = finished[0]
    assert (
        rec.request_id == "trace-123"
        and rec.generation_tokens == 2
        and rec.e2e_s >= rec.ttft_s >= 0
    )
    access = [rec for rec in caplog.records if rec.name == "beamline.access"]
    assert access and access[-1].status == 200
    line = json.loads(JsonFormatter().format(rec))
    assert line["request_id"] == "trace-123" and line["finish_reason"] == "length"


async def test_a_missing_or_unsafe_request_id_is_replaced(client: httpx.AsyncClient) -> None:
    r = await client.get("/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert (
        r.headers["x-request-id"] != "bad id\twith spaces" and len(r.headers["x-request-id"]) == 32
    )
    r = await client.get("/health")
    assert len(r.headers["x-request-id"]) == 32
