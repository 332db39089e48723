"""The list of request fields beyond OpenAI's (server/api/extension_fields.py) against the request
models, vLLM's own field names (tests/fixtures/vllm_request_fields.json) and the docs' table
(docs/reference/request-fields.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ValidationError

from server.api.extension_fields import BY_NAME, FIELDS, OPENAI_FIELDS, ExtensionField
from server.api.field_docs import END, PAGE, START, with_table
from server.api.protocol import ChatCompletionRequest, CompletionRequest, VLLMStreamOptions

ROOT = Path(__file__).resolve().parents[1]
MODELS: dict[str, type[BaseModel]] = {
    "completions": CompletionRequest,
    "chat": ChatCompletionRequest,
}
MINIMAL: dict[str, dict[str, Any]] = {
    "completions": {"prompt": "x"},
    "chat": {"messages": [{"role": "user", "content": "x"}]},
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
VLLM = json.loads((ROOT / "tests" / "fixtures" / "vllm_request_fields.json").read_text())


def body_with(name: str, value: Any) -> dict[str, Any]:
    """`stream_options.continuous_usage_stats` -> {"stream_options": {...: value}}."""
    head, _, rest = name.partition(".")
    return {head: body_with(rest, value) if rest else value}


def declared(model: type[BaseModel]) -> set[str]:
    """The field names a request model takes, members of stream_options included."""
    names = {info.alias or name for name, info in model.model_fields.items()}
    return names | {f"stream_options.{name}" for name in VLLMStreamOptions.model_fields}


def listed(endpoint: str, *statuses: str) -> set[str]:
    return {f.name for f in FIELDS if endpoint in f.endpoints and f.status in statuses}


def test_the_list_names_each_field_once_with_a_one_line_meaning() -> None:
    assert len(BY_NAME) == len(FIELDS)
    for f in FIELDS:
        assert f.meaning and "\n" not in f.meaning and len(f.meaning) < 200, f.name
        assert not set(f.endpoints) - set(MODELS), f.name


@pytest.mark.parametrize("endpoint", MODELS)
def test_every_field_a_model_declares_is_listed_or_an_openai_field(endpoint: str) -> None:
    accepted = listed(endpoint, "implemented", "no effect")
    assert declared(MODELS[endpoint]) == accepted | OPENAI_FIELDS[endpoint]
    assert not accepted & OPENAI_FIELDS[endpoint]


@pytest.mark.parametrize(
    "entry", [f for f in FIELDS if f.status != "refused"], ids=lambda f: f.name
)
def test_every_accepted_field_is_taken_by_its_endpoints_only(entry: ExtensionField) -> None:
    for endpoint, model in MODELS.items():
        body = {**MINIMAL[endpoint], **body_with(entry.name, entry.example)}
        if endpoint in entry.endpoints or entry.name in OPENAI_FIELDS[endpoint]:
            model.model_validate(body)
        else:
            with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
                model.model_validate(body)


@pytest.mark.parametrize("snapshot", VLLM["snapshots"], ids=["main", "older"])
@pytest.mark.parametrize("endpoint", MODELS)
def test_every_vllm_field_is_listed_or_an_openai_field(endpoint: str, snapshot: dict) -> None:
    names = set(snapshot[endpoint]) | {f"stream_options.{n}" for n in snapshot["stream_options"]}
    known = listed(endpoint, "implemented", "no effect", "refused") | OPENAI_FIELDS[endpoint]
    assert names - known == set()


async def test_every_refused_field_is_a_400_naming_it(client: httpx.AsyncClient) -> None:
    for f in (f for f in FIELDS if f.status == "refused"):
        for endpoint in f.endpoints:
            assert f.name not in declared(MODELS[endpoint])
            body = {**MINIMAL[endpoint], "max_tokens": 1, **body_with(f.name, {"x": 1})}
            r = await client.post(PATHS[endpoint], json=body)
            assert r.status_code == 400, (f.name, r.text)
            error = r.json()["error"]
            assert (error["param"], error["code"]) == (f.name, "unsupported"), error
            assert f.name in error["message"] and f.meaning in error["message"]


async def test_an_unlisted_unknown_field_is_still_unknown(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "x", "temprature": 0.5})
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (400, "temprature", "unknown_field")


def test_the_docs_table_is_generated_from_the_list() -> None:
    page = PAGE.read_text()
    assert START in page and END in page
    assert with_table(page) == page, "run: python -m server.api.field_docs"
