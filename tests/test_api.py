"""HTTP behaviour of the OpenAI-compatible routes, through httpx's ASGI transport."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from decoding import DecodingParams
from server.api.app import create_app
from server.api.serving import ServingContext
from tests.conftest import make_engine
from tests.engine_driver import generate as engine_generate


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]


async def test_health_is_ok_once_loaded_and_503_before(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    app = create_app()  # no context and no loader: never loaded
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503


async def test_completion_body_usage_and_greedy_text(
    client: httpx.AsyncClient, tiny_ctx: ServingContext, llama_dir: Path
) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Hello world",
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    prompt_ids = tiny_ctx.tokenizer("Hello world").input_ids
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 7,
        "total_tokens": len(prompt_ids) + 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # Same text as the engine produces for the same request outside HTTP.
    engine = make_engine(llama_dir)
    direct = engine_generate(
        engine, [prompt_ids], DecodingParams(max_tokens=7, temperature=0, ignore_eos=True)
    )
    assert choice["text"] == direct[0].text


async def test_streamed_completion_matches_non_streamed_and_ends_with_usage_and_done(
    client: httpx.AsyncClient,
) -> None:
    req = {"prompt": "The quick brown fox", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=req)).json()
    # The same prompt again: its full blocks (of 4 tokens) are served from the prefix cache.
    cached = {"cached_tokens": (plain["usage"]["prompt_tokens"] - 1) // 4 * 4}
    assert cached["cached_tokens"] > 0 and plain["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    r = await client.post(
        "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert text == plain["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {**plain["usage"], "prompt_tokens_details": cached}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_stream_without_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in events[:-1])


async def test_chat_completion_and_its_stream(client: httpx.AsyncClient) -> None:
    req = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello!"},
        ],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = await client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 6
    r = await client.post("/v1/chat/completions", json={**req, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == body["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_several_prompts_give_one_choice_each_in_order(client: httpx.AsyncClient) -> None:
    prompts = ["Hello", "The quick", "Once upon"]
    r = await client.post(
        "/v1/completions",
        json={"prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, p in enumerate(prompts):
        single = (
            await client.post(
                "/v1/completions",
                json={"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            )
        ).json()
        assert body["choices"][i]["text"] == single["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 12


async def test_token_id_prompt_is_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


def assert_openai_error(
    r: httpx.Response, status: int, type_: str, param: str | None, code: str | None
) -> None:
    """Exactly OpenAI's error shape, with these status, type, param and code."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, param, code), err
    assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
        ({"prompt": "x", "top_k": -1}, 400, "top_k", "invalid_value"),
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
        ({"prompt": ""}, 400, "prompt", "empty_prompt"),
        ({"prompt": []}, 400, "prompt", "empty_prompt"),
        ({"prompt": [1, -2]}, 400, "prompt", "invalid_value"),  # not the union branch 'prompt.str'
        ({"prompt": [10**6]}, 400, "prompt", "invalid_token"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": [5] * 512, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "x", "n": 17}, 400, "n", "above_limit"),
        (
            {"prompt": "x", "num_beams": 3, "num_beam_groups": 2},
            400,
            "num_beam_groups",
            "invalid_value",
        ),
        ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", "invalid_value"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "above_limit"),
        ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "too_many_stop"),
        ({"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
        ({"max_tokens": 3}, 400, "prompt", "invalid_value"),
    ],
)
async def test_bad_completion_requests_get_openai_shaped_4xx(
    client: httpx.AsyncClient, body: dict, status: int, param: str | None, code: str
) -> None:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert_openai_error(r, status, ERROR_TYPES[status], param, code)
    # The server still serves after each bad request.
    ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b'{"prompt": "x",', "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"[1, 2]", "invalid_value"),
        (b"null", "invalid_value"),
    ],
)
async def test_malformed_json_and_non_object_bodies_are_400(
    client: httpx.AsyncClient, raw: bytes, code: str
) -> None:
    r = await client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 400, "invalid_request_error", None, code)


async def test_context_length_error_names_both_numbers(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    r = await client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 5000})
    assert_openai_error(r, 400, "invalid_request_error", "max_tokens", "context_length_exceeded")
    msg = r.json()["error"]["message"]
    assert str(tiny_ctx.max_model_len) in msg and "5000" in msg


async def test_unknown_route_and_wrong_method_keep_the_error_shape(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/v1/nothing")
    assert_openai_error(r, 404, "not_found_error", None, None)
    r = await client.get("/v1/completions")
    assert_openai_error(r, 405, "invalid_request_error", None, None)
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
    ],
)
async def test_bad_chat_requests(client: httpx.AsyncClient, body: dict, param: str) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    assert_openai_error(r, 400, "invalid_request_error", param, "invalid_value")
