"""A model whose tokenizer the grammar engine cannot read (a WordPiece decoder: llguidance says
"can't determine decoder type") serves: start-up logs that structured outputs are off, plain
requests answer, and only constrained ones get a 400 that says why, naming their field."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import started_client
from tests.tiny_models import build_tiny_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def wordpiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its tokenizer's decoder swapped for WordPiece's."""
    path = build_tiny_model(tmp_path_factory.mktemp("wordpiece") / "llama", "llama")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["decoder"] = {"type": "WordPiece", "prefix": "##", "cleanup": True}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


@pytest.fixture
async def client(
    wordpiece_model: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[httpx.AsyncClient]:
    caplog.set_level(logging.WARNING, logger="server.grammars")
    async with started_client(wordpiece_model, "wp") as c:  # start-up as `beamline serve` runs
        warnings: list[str] = []
        for _ in range(100):  # the grammar engine reads the tokenizer once the server is ready
            warnings = [r.getMessage() for r in caplog.records if r.name == "server.grammars"]
            if warnings:
                break
            await asyncio.sleep(0.1)
        assert warnings == [
            "structured outputs are off for this model: the grammar engine (llguidance) cannot "
            "read its tokenizer: can't determine decoder type: Some(WordPiece(WordPiece { prefix: "
            '"##", cleanup: true }))'
        ]
        yield c


@pytest.mark.parametrize(
    "route, field, value, param",
    [
        ("completions", "response_format", {"type": "json_object"}, "response_format"),
        ("completions", "structured_outputs", {"regex": "[0-9]+"}, "structured_outputs.regex"),
        (
            "chat/completions",
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            "response_format.json_schema.schema",
        ),
    ],
)
async def test_constrained_requests_get_a_400_that_says_why_and_plain_ones_serve(
    client: httpx.AsyncClient, route: str, field: str, value: dict, param: str
) -> None:
    body: dict = {"model": "wp", **COMPLETION}
    if route == "chat/completions":
        body = {"model": "wp", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    refused = await client.post(f"/v1/{route}", json={**body, field: value})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "structured_outputs_unavailable"
    assert error["param"] == param
    assert error["message"].startswith(
        f"{param}: structured outputs are not available for this model: the grammar engine "
        "(llguidance) cannot read its tokenizer: can't determine decoder type"
    )
    served = await client.post(f"/v1/{route}", json=body)  # the same request, unconstrained
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 6
