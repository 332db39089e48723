"""Errors that say what to fix: every problem, JSON positions, Content-Type, prompts too long for
the context, messages without content."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server.api.errors import MAX_PROBLEMS
from server.api.serving import ServingContext

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "Hi"}


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_every_validation_problem_is_named(client: httpx.AsyncClient) -> None:
    body = {"prompt": "x", "temperature": "hot", "top_p": [1], "n": "two"}
    err = error_of(await client.post(COMP, json=body))
    assert err["message"].startswith("3 problems: ") and err["code"] == "invalid_value"
    assert all(f"{name}: " in err["message"] for name in ("temperature", "top_p", "n"))
    assert err["param"] == "temperature"
    many = {"prompt": "x", **{f"unknown_{i}": 1 for i in range(MAX_PROBLEMS + 3)}}
    err = error_of(await client.post(COMP, json=many))
    assert err["message"].startswith(f"{MAX_PROBLEMS + 3} problems: ")
    assert err["message"].endswith("; and 3 more") and err["message"].count("unknown field") == 10
    assert (err["param"], err["code"]) == ("unknown_0", "unknown_field")


async def test_a_json_syntax_error_gives_line_column_and_text(client: httpx.AsyncClient) -> None:
    raw = b'{\n  "prompt": "x",\n  "max_tokens": 5,,\n  "n": 1\n}'
    err = error_of(
        await client.post(COMP, content=raw, headers={"content-type": "application/json"})
    )
    assert err["code"] == "invalid_json" and err["param"] is None
    assert "line 3, column 19" in err["message"] and '"max_tokens": 5,,' in err["message"]


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded; charset=utf-8"]
)
async def test_a_json_body_is_read_whatever_content_type_a_simple_client_sent(
    client: httpx.AsyncClient, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    raw = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    r = await client.post(COMP, content=raw, headers=headers)
    assert r.status_code == 200, r.text
    err = error_of(await client.post(COMP, content=b"prompt=Hi&max_tokens=2", headers=headers))
    assert err["code"] == "invalid_json"
    assert f"Content-Type: {content_type or '(none)'}" in err["message"]
    assert "application/json" in err["message"]


async def test_another_content_type_is_named_in_the_error(client: httpx.AsyncClient) -> None:
    multipart = "multipart/form-data; boundary=x"
    raw = b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nHi\r\n--x--'
    err = error_of(await client.post(COMP, content=raw, headers={"content-type": multipart}))
    assert "must be a JSON object" in err["message"] and multipart in err["message"]
    assert "application/json" in err["message"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "system", "content": None}, USER], "messages.0.content"),
        ([{"role": "developer"}, USER], "messages.0.content"),
        ([USER, {"role": "assistant"}], "messages.1.content"),
        ([USER, {"role": "assistant", "tool_calls": []}], "messages.1.content"),
        (
            [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c1"},
            ],
            "messages.2.content",
        ),
    ],
)
async def test_a_message_without_content_is_a_400_naming_it(
    client: httpx.AsyncClient, messages: list, param: str
) -> None:
    err = error_of(await client.post(CHAT, json={"messages": messages, "max_tokens": 1}))
    assert (err["param"], err["code"]) == (param, "missing_required_parameter")
    assert "needs content" in err["message"]


async def test_empty_content_and_tool_call_only_assistants_are_fine(
    client: httpx.AsyncClient,
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": ""},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": ""},
    ]
    r = await client.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


async def test_a_prompt_longer_than_the_context_names_the_prompt(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    long = "x " * 600
    err = error_of(await client.post(CHAT, json={"messages": [{"role": "user", "content": long}]}))
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    assert (
        str(tiny_ctx.max_model_len) in err["message"] and "shorten the messages" in err["message"]
    )
    err = error_of(await client.post(COMP, json={"prompt": long}))
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
    err = error_of(await client.post(COMP, json={"prompt": "Hi", "max_tokens": 5000}))
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert "at most" in err["message"]
