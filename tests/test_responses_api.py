"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) on the tiny model:
the same tokens as chat for the same conversation, forced function calls, structured output,
the streamed events and their order, the official client (create, stream, parse, retrieve),
`previous_response_id` and the store's limits, every refusal a 400 naming its field, and
nothing left behind by an engine failure or a client that hangs up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from server.config import ServerConfig
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server
from tests.reliability_helpers import aborted_total, assert_openai_error, wait_until_idle
from tests.test_disconnects import hang_up, metrics_text, raw_request, read_events, wait_running
from tests.tiny_models import build_tiny_model

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
ASK = "What is the weather in Paris?"
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["fox", "dog"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["animal", "legs"],
    "additionalProperties": False,
}
EOS_OFF = {"ignore_eos": True}  # a random model stops anywhere; max_output_tokens ends these
GREEDY = {"model": "tiny", "temperature": 0, **EOS_OFF}
FORCED = {"tools": [TOOL], "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 80}


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with room for prompts that list tools."""
    return build_tiny_model(
        tmp_path_factory.mktemp("long_llama") / "llama", "llama", max_position_embeddings=2048
    )


@pytest.fixture
def tiny_ctx(long_llama_dir: Path) -> Iterator[ServingContext]:
    ctx = serving_context(make_engine(long_llama_dir, num_blocks=2048))
    yield ctx
    ctx.engine.shutdown()


@pytest.fixture
async def client(tiny_ctx: ServingContext) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(ctx=tiny_ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def respond(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def chat_text(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def events_of(body: str) -> list[dict[str, Any]]:
    """The SSE events, each `event: <type>` then `data: <json>` of that type."""
    events = []
    for frame in body.split("\n\n")[:-1]:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def check_call(item: dict[str, Any]) -> None:
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    assert item["status"] == "completed"
    jsonschema.validate(json.loads(item["arguments"]), WEATHER_SCHEMA)


# ---- one response --------------------------------------------------------------------------------
async def test_the_same_conversation_gives_chat_s_tokens(client: httpx.AsyncClient) -> None:
    said = [{"type": "output_text", "text": "Hi!", "annotations": []}]
    conversation = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": said,
        },
        {"role": "user", "content": "How are you?"},
    ]
    response = await respond(
        client, input=conversation, instructions="Be brief.", max_output_tokens=8, **GREEDY
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "How are you?"},
    ]
    r = await client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, **GREEDY}
    )
    chat = r.json()
    assert output_text(response) == chat["choices"][0]["message"]["content"]
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["usage"]["output_tokens"] == 8
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "incomplete" and message["id"].startswith("msg_")
    assert (
        message["content"][0]["type"] == "output_text"
        and message["content"][0]["annotations"] == []
    )
    assert response["instructions"] == "Be brief." and response["max_output_tokens"] == 8
    assert response["temperature"] == 0 and response["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
async def test_a_forced_function_call_and_the_turn_after_it(
    client: httpx.AsyncClient, choice: Any
) -> None:
    response = await respond(client, model="tiny", input=ASK, tool_choice=choice, **FORCED)
    assert response["status"] == "completed"
    (call,) = response["output"]  # a reply that is only a call has no message item
    check_call(call)
    assert response["tools"][0]["name"] == "get_weather" and response["tool_choice"] == choice
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    after = await respond(
        client,
        input=[{"role": "user", "content": ASK}, call, result],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=6,
        **GREEDY,
    )
    chat_call = {
        "id": call["call_id"],
        "type": "function",
        "function": {"name": call["name"], "arguments": call["arguments"]},
    }
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"},
    ]
    expected = await chat_text(
        client, messages=messages, tools=[CHAT_TOOL], tool_choice="none", max_tokens=6, **GREEDY
    )
    assert output_text(after) == expected


async def test_text_format_constrains_the_output(client: httpx.AsyncClient) -> None:
    fmt = {"type": "json_schema", "name": "pet", "schema": PET_SCHEMA, "strict": True}
    for strategy in ({"temperature": 0}, {"num_beams": 2}, {"temperature": 1.0, "seed": 1}):
        response = await respond(
            client,
            model="tiny",
            input="A pet",
            text={"format": fmt},
            max_output_tokens=60,
            **strategy,
        )
        assert response["status"] == "completed", response
        jsonschema.validate(json.loads(output_text(response)), PET_SCHEMA)
        assert response["text"]["format"]["schema"] == PET_SCHEMA
    response = await respond(
        client,
        input="Any object",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    assert isinstance(json.loads(output_text(response)), dict)


# ---- streams -------------------------------------------------------------------------------------
async def test_a_streamed_text_response_in_openai_s_event_order(client: httpx.AsyncClient) -> None:
    body = {"input": "Hello", "max_output_tokens": 6, **GREEDY}
    whole = await respond(client, **body)
    r = await client.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == output_text(whole) == events[-4]["text"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and output_text(final) == text
    assert final["usage"]["output_tokens"] == 6 and events[0]["response"]["status"] == "in_progress"
    item_id = events[2]["item"]["id"]
    assert all(e.get("item_id", item_id) == item_id for e in events[2:-1])
    assert events[-2]["item"]["status"] == "incomplete" and final["output"][0]["id"] == item_id


async def test_a_streamed_function_call(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/responses", json={"input": ASK, "tool_choice": "required", "stream": True, **FORCED}
    )
    events = events_of(r.text)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done, completed = events[2:]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    check_call(item_done["item"])
    assert completed["response"]["output"] == [item_done["item"]]


async def test_an_engine_failure_ends_the_stream_with_response_failed(
    client: httpx.AsyncClient, tiny_ctx: ServingContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_ctx.engine.engine.runner  # type: ignore[attr-defined]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated device error")

    monkeypatch.setattr(runner, "execute", broken)
    r = await client.post("/v1/responses", json={"input": "Hi", "stream": True, **GREEDY})
    events = events_of(r.text)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert "simulated device error" in events[2]["message"]
    assert events[3]["response"]["status"] == "failed"
    assert events[3]["response"]["error"]["code"] == "server_error"
    r = await client.post("/v1/responses", json={"input": "Hi", **GREEDY})
    assert_openai_error(r, 500, code="engine_error")
    stats = await wait_until_idle(client)
    assert stats["num_requests_in_flight"] == 0


# ---- the official client -------------------------------------------------------------------------
class Pet(pydantic.BaseModel):
    animal: Literal["fox", "dog"]
    legs: int = pydantic.Field(ge=0, le=8)


def test_the_openai_client_creates_streams_parses_and_retrieves(tiny_ctx: ServingContext) -> None:
    with live_server(create_app(ctx=tiny_ctx)) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        created = oa.responses.create(
            model="tiny", input="Hello", max_output_tokens=6, temperature=0, extra_body=EOS_OFF
        )
        assert created.status == "incomplete" and created.output_text
        assert created.usage is not None and created.usage.output_tokens == 6
        assert oa.responses.retrieve(created.id).output_text == created.output_text
        follow = oa.responses.create(
            model="tiny", input="More", previous_response_id=created.id, max_output_tokens=4
        )
        assert follow.previous_response_id == created.id and follow.usage is not None
        assert follow.usage.input_tokens > created.usage.total_tokens  # the history came first

        # The stream helper accumulates the events (and checks them) into the final response.
        pet = {"model": "tiny", "input": "A pet", "max_output_tokens": 60, "temperature": 0}
        parsed = oa.responses.parse(text_format=Pet, **pet)  # type: ignore[arg-type]
        assert isinstance(parsed.output_parsed, Pet)
        with oa.responses.stream(text_format=Pet, **pet) as stream:  # type: ignore[arg-type]
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == parsed.output_text
        assert final.output_parsed == parsed.output_parsed and final.status == "completed"
        with oa.responses.stream(
            model="tiny",
            input=ASK,
            tools=[TOOL],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=80,
        ) as stream:
            (call,) = stream.get_final_response().output
        assert call.type == "function_call"
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
        with pytest.raises(openai.BadRequestError) as info:
            oa.responses.create(model="tiny", input="x", reasoning={"effort": "high"})
        assert info.value.body["param"] == "reasoning.effort"  # type: ignore[index]


# ---- previous_response_id and the store ----------------------------------------------------------
async def test_previous_response_id_continues_the_conversation(client: httpx.AsyncClient) -> None:
    first = await respond(
        client, input="Hello", instructions="Be brief.", max_output_tokens=5, **GREEDY
    )
    second = await respond(
        client, input="And then?", previous_response_id=first["id"], max_output_tokens=5, **GREEDY
    )
    third = await respond(
        client,
        input=[{"role": "user", "content": "Why?"}],
        previous_response_id=second["id"],
        instructions="Be kind.",
        max_output_tokens=5,
        **GREEDY,
    )
    messages = [  # instructions are not carried over: each response has its own
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": output_text(first)},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": output_text(second)},
        {"role": "user", "content": "Why?"},
    ]
    assert output_text(third) == await chat_text(client, messages=messages, max_tokens=5, **GREEDY)
    assert third["previous_response_id"] == second["id"]
    r = await client.get(f"/v1/responses/{third['id']}")
    assert r.status_code == 200 and r.json() == third


async def test_the_store_keeps_the_last_responses_and_honours_store_false(
    tiny_ctx: ServingContext,
) -> None:
    for size in (2, 0):
        app = create_app(ctx=tiny_ctx, config=ServerConfig(responses_store_size=size))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            ids = [
                (await respond(c, input=f"Hi {i}", max_output_tokens=1, **GREEDY))["id"]
                for i in range(3)
            ]
            unkept = await respond(c, input="Hi", store=False, max_output_tokens=1, **GREEDY)
            assert unkept["store"] is False
            for gone in (ids[0], unkept["id"], *(ids[1:] if size == 0 else [])):
                assert_openai_error(
                    await c.get(f"/v1/responses/{gone}"), 404, code="response_not_found"
                )
            for kept in ids[1:] if size else []:
                assert (await c.get(f"/v1/responses/{kept}")).json()["id"] == kept
            r = await c.post("/v1/responses", json={"input": "x", "previous_response_id": ids[0]})
            code = "previous_response_not_found" if size else "unsupported"
            assert_openai_error(r, 400, param="previous_response_id", code=code)


# ---- refusals ------------------------------------------------------------------------------------
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"input": []}, "input", "empty_prompt"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
        "unsupported",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
        "input[0].content[0].type",
        "invalid_value",
    ),
    (
        {"input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "x"}]},
        "input[1].type",
        "unsupported",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
        "input[0].content[0].text",
        "invalid_value",
    ),
    (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        "invalid_value",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        "invalid_value",
    ),
    (
        {"tools": [TOOL], "text": {"format": {"type": "json_object"}}},
        "text.format",
        "conflicting_fields",
    ),
    (
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {"type": "string", "minLength": 5, "maxLength": 2},
                }
            }
        },
        "text.format.schema",
        "invalid_grammar",
    ),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "unsupported"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"max_output_tokens": 100_000}, "max_output_tokens", "context_length_exceeded"),
    ({"max_tokens": 5}, "max_tokens", "unsupported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported"),
    ({"n": 2}, "n", "unsupported"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "unsupported"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "unsupported"),
    ({"background": True}, "background", "unsupported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "unsupported"),
    ({"truncation": "auto"}, "truncation", "unsupported"),
    ({"top_logprobs": 2}, "top_logprobs", "unknown_field"),
    ({"conversation": "conv_1"}, "conversation", "unknown_field"),
    ({"temperature": -1}, "temperature", "invalid_value"),
    ({"min_tokens": 10, "max_output_tokens": 2}, "min_tokens", "invalid_value"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
]


async def test_every_refusal_is_a_400_naming_the_field(client: httpx.AsyncClient) -> None:
    for fields, param, code in BAD:
        r = await client.post("/v1/responses", json={"input": "Hi", **fields})
        error = assert_openai_error(r, 400, code=code)
        assert error["param"] == param, (fields, error)
    assert_openai_error(await client.post("/v1/responses", json={}), 400, param="input")
    assert_openai_error(
        await client.post("/v1/responses", json={"model": "nope", "input": "x"}), 404, param="model"
    )
    assert_openai_error(await client.get("/v1/responses/resp_nope"), 404)
    harmless = {
        "metadata": {"k": "v"},
        "user": "u",
        "truncation": "disabled",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "reasoning": {"effort": None},
        "include": [],
        "background": False,
        "store": True,
        "text": {"verbosity": "medium"},
    }
    response = await respond(client, input="Hi", max_output_tokens=1, **harmless)
    assert response["metadata"] == {"k": "v"} and response["user"] == "u"


# ---- clients that go away ------------------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_a_client_that_hangs_up_is_aborted_and_frees_everything(
    tiny_ctx: ServingContext,
) -> None:
    body = {"input": "Once upon a time", "max_output_tokens": 400, **GREEDY}
    with live_server(create_app(ctx=tiny_ctx)) as url:
        host, port = url.removeprefix("http://").split(":")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            aborted = aborted_total(await metrics_text(client))
            for stream in (True, False):
                head, payload = raw_request("/v1/responses", {**body, "stream": stream}, host)
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(head + payload)
                await writer.drain()
                if stream:
                    await read_events(reader, 4, timeout=10)
                else:
                    await wait_running(client)
                await hang_up(writer, reset=False)
                stats = await wait_until_idle(client, timeout=5)
                assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
                assert stats["num_requests_in_flight"] == 0
            assert aborted_total(await metrics_text(client)) == aborted + 2
