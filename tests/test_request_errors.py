"""Errors that say what to fix (every problem, JSON positions, Content-Type, prompts too long for
the context, messages without content), the server's max_tokens default and cap, and the model's
own sampling defaults (generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from decoding import DecodingParams
from server.api.app import create_app
from server.api.errors import MAX_PROBLEMS, APIError
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.request_params import decoding_params
from server.api.sampling_defaults import read_sampling_defaults
from server.api.serving import ServingContext
from server.config import ConfigError, ServerConfig, load_config
from server.engine.client import KVCapacity

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
async def test_a_body_not_sent_as_json_gets_an_error_naming_the_header(
    client: httpx.AsyncClient, content_type: str | None
) -> None:
    """`curl -d '{...}'` without `-H` (a form), `requests.post(data=...)` (no Content-Type):
    a 400 that names the header and its fix. Such bodies are not read as JSON anyway: browsers
    send them to any site without a CORS preflight."""
    raw = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    headers = {"content-type": content_type} if content_type else {}
    err = error_of(await client.post(COMP, content=raw, headers=headers))
    assert err["code"] == "invalid_content_type" and err["param"] is None
    assert (content_type or "no Content-Type") in err["message"]
    assert "Content-Type: application/json" in err["message"]
    json_ok = await client.post(COMP, content=raw, headers={"content-type": "application/json"})
    assert json_ok.status_code == 200, json_ok.text


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


# ---- max_tokens: the server's default and cap ----------------------------------------------------
def context(defaults: dict[str, Any] | None = None, **config: Any) -> ServingContext:
    engine = SimpleNamespace(
        kv_capacity=KVCapacity(num_blocks=256, block_size=16), eos_token_ids=frozenset({2})
    )
    return ServingContext(
        engine=engine,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        model_name="m",
        max_model_len=512,
        vocab_size=1000,
        config=ServerConfig(**config),
        model_sampling_defaults=defaults or {},
    )


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [USER], **fields})


def test_a_chat_request_without_max_tokens_gets_the_servers_default() -> None:
    assert decoding_params(context(default_max_tokens=8), chat(), 10, None, None).max_tokens == 8
    rest = decoding_params(context(default_max_tokens=0), chat(), 10, None, None)
    assert rest.max_tokens == 502  # 0: the rest of the context
    room = decoding_params(context(default_max_tokens=4096), chat(), 10, None, None)
    assert room.max_tokens == 502  # within the context


def test_max_tokens_above_the_limit_is_a_400_naming_the_field() -> None:
    ctx = context(max_tokens_limit=50, default_max_tokens=20)
    assert decoding_params(ctx, chat(max_tokens=50), 10, 50, None).max_tokens == 50
    assert decoding_params(ctx, chat(), 10, None, None).max_tokens == 20
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(APIError) as caught:
            decoding_params(ctx, chat(**{param: 51}), 10, 51, None, max_tokens_param=param)
        assert (caught.value.param, caught.value.code) == (param, "above_limit")


def test_the_default_may_not_exceed_the_limit() -> None:
    with pytest.raises(ConfigError, match="default_max_tokens"):
        load_config(None, {"default_max_tokens": 100, "max_tokens_limit": 50}, environ={})
    assert load_config(None, {"default_max_tokens": 0, "max_tokens_limit": 50}, environ={})


# ---- the model's sampling defaults ---------------------------------------------------------------
def test_the_sampling_defaults_are_read_from_generation_config(tmp_path: Path) -> None:
    config = {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 1.5,  # not a valid top_p: left out
        "min_p": 0.05,
        "do_sample": True,
        "max_new_tokens": 100,
        "eos_token_id": [1, 106],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "min_p": 0.05}
    assert read_sampling_defaults(tmp_path / "missing") == {}


def test_sampling_defaults_apply_only_to_fields_a_request_leaves_unset() -> None:
    defaults = {"temperature": 0.5, "top_k": 7, "repetition_penalty": 1.3}
    ctx = context(defaults)
    req = CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 1.0, "top_k": 0, "top_p": None}
    )
    params = decoding_params(ctx, req, 4, 16, None)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (1.0, 0, 1.3)
    bare = decoding_params(ctx, CompletionRequest(prompt="x"), 4, 16, None)
    assert (bare.temperature, bare.top_k, bare.repetition_penalty) == (0.5, 7, 1.3)
    off = decoding_params(context(defaults, generation_config_defaults=False), chat(), 4, 16, None)
    assert off == DecodingParams(max_tokens=16)


async def test_models_route_says_which_sampling_defaults_apply(
    tiny_ctx: ServingContext,
) -> None:
    tiny_ctx.model_sampling_defaults = {"top_k": 40}
    for applied in (True, False):
        tiny_ctx.config = ServerConfig(generation_config_defaults=applied)
        app = create_app(ctx=tiny_ctx)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            (card,) = (await c.get("/v1/models")).json()["data"]
            assert card["sampling_defaults"] == ({"top_k": 40} if applied else {})
            r = await c.post(COMP, json={"prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200
