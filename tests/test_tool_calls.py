"""Chat tool calling: the prompt (native and fallback rendering), forced calls by constrained
decoding, reading calls from replies, streaming deltas, and the official openai client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server.api import tools
from server.api.app import create_app
from server.api.protocol import ChatCompletionRequest
from server.api.serving import ServingContext, chat_prompt_ids
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server
from tests.tiny_models import build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
UNSATISFIABLE = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "string", "minLength": 5, "maxLength": 2}},
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
JSON_OBJECT = {"type": "json_object"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CHAT = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 400}
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with room for a prompt that lists tools (its tokenizer spends a token on
    every few characters)."""
    path = tmp_path_factory.mktemp("long_llama") / "llama"
    return build_tiny_model(path, "llama", max_position_embeddings=2048)


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


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


# ---- the prompt ---------------------------------------------------------------------------------
def test_template_tool_format_is_read_from_the_template() -> None:
    assert tools.template_tool_format(None) is None
    assert tools.template_tool_format("{{ messages }}") is None  # no tool calls rendered
    assert tools.template_tool_format(HERMES_TEMPLATE) == "hermes"
    llama = "{% if m.tool_calls %}<|python_tag|>{{ c | tojson }}{% endif %}ipython"
    assert tools.template_tool_format(llama) == "llama3_json"


def test_fallback_rendering_of_tools_calls_and_results(tiny_ctx: ServingContext) -> None:
    """The tiny model's template has no tool format: tools, calls and results are rendered as
    documented text, and no message is dropped."""
    req = ChatCompletionRequest(model="tiny", messages=ROUND_TRIP, tools=TOOLS)  # type: ignore[arg-type]
    plan = tools.plan_tools(req, tiny_ctx.tokenizer.chat_template)
    assert plan.native is None and plan.mode == "auto"
    text = tiny_ctx.tokenizer.decode(chat_prompt_ids(tiny_ctx, req, plan))
    assert "You can call the following tools" in text and '"name": "get_time"' in text
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
    assert call in text
    assert (
        '<|user|><tool_response>{"tool_call_id": "call_1", "name": "get_weather", '
        '"content": "sunny, 21 C"}</tool_response>'
    ) in text
    assert text.index("Weather in Paris?") < text.index(call) < text.index("sunny")


def test_native_rendering_passes_tools_calls_and_tool_messages(
    tiny_ctx: ServingContext,
) -> None:
    tiny_ctx.tokenizer.chat_template = HERMES_TEMPLATE
    req = ChatCompletionRequest(model="tiny", messages=ROUND_TRIP, tools=TOOLS)  # type: ignore[arg-type]
    plan = tools.plan_tools(req, HERMES_TEMPLATE)
    assert plan.native == "hermes"
    text = tiny_ctx.tokenizer.decode(chat_prompt_ids(tiny_ctx, req, plan))
    assert text.startswith("<|system|>tools: [") and '"get_time"' in text
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
    assert f"<|assistant|><tool_call>{call}</tool_call>" in text  # arguments as an object
    assert "<|tool|>sunny, 21 C" in text  # the tool role reaches the template as itself


# ---- reading replies ----------------------------------------------------------------------------
def test_parse_hermes_llama3_and_forced_replies() -> None:
    req = ChatCompletionRequest(model="tiny", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    hermes = tools.plan_tools(req, HERMES_TEMPLATE)
    reply = (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
    )  # the last block is cut before its closing tag
    parsed = tools.parse_reply(reply, hermes)
    assert parsed.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert tools.parse_reply(unknown, hermes).tool_calls == []  # not a declared tool: text
    llama = tools.plan_tools(req, "{{ m.tool_calls }}<|python_tag|>")
    reply = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'  # noqa: E501
    parsed = tools.parse_reply(reply, llama)
    assert parsed.content is None and len(parsed.tool_calls) == 2
    assert tools.parse_reply("The weather is fine.", llama).tool_calls == []


def test_reply_stream_holds_back_only_what_may_be_a_call() -> None:
    req = ChatCompletionRequest(model="tiny", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    stream = tools.ReplyStream(tools.plan_tools(req, HERMES_TEMPLATE))
    sent = [stream.push(d) for d in ["Sure", ", <tool", "_c", "all>{", '"name": "get_time", ']]
    assert "".join(sent) == "Sure, "
    stream.push('"arguments": {"zone": "UTC"}}</tool_call>')
    tail, parsed = stream.finish()
    assert tail == "" and [c.function.name for c in parsed.tool_calls] == ["get_time"]
    plain = tools.ReplyStream(tools.plan_tools(req, HERMES_TEMPLATE))
    assert plain.push("a <b> c <tool") == "a <b> c "
    assert plain.finish()[0] == "<tool"  # never became a call: the rest is content


# ---- forced calls over HTTP ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy",
    [{"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}, {"num_beams": 3, "n": 2}],
    ids=["greedy", "n", "beams"],
)
async def test_required_tool_choice_always_calls_a_tool(
    client: httpx.AsyncClient, strategy: dict
) -> None:
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, **strategy, "tool_choice": "required"}
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        check_calls(choice["message"]["tool_calls"], {"get_weather", "get_time"})


async def test_named_function_and_single_calls(client: httpx.AsyncClient) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "temperature": 0.9, "seed": 1, "tool_choice": named}
    )
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    check_calls([call], {"get_time"})
    r = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "tool_choice": "required", "parallel_tool_calls": False, "seed": 2},
    )
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


async def test_tool_choice_none_and_auto_reply_with_text(client: httpx.AsyncClient) -> None:
    for choice in ("none", "auto"):
        r = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "max_tokens": 6, "temperature": 0, "tool_choice": choice},
        )
        body = r.json()["choices"][0]
        assert r.status_code == 200 and body["finish_reason"] in ("stop", "length")
        assert "tool_calls" not in body["message"] and isinstance(body["message"]["content"], str)


async def test_streamed_tool_calls_arrive_as_openai_deltas(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True, "tool_choice": "required", "temperature": 0}
    deltas, reasons = [], []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    deltas.append(choice["delta"])
                    reasons.append(choice["finish_reason"])
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any(d.get("content") for d in deltas[1:])  # the JSON is never sent as text
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    check_calls(calls, {"get_weather", "get_time"})
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required", "response_format": JSON_OBJECT}, "response_format"),
        ({"response_format": JSON_OBJECT}, "response_format"),  # with auto
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"tools": [UNSATISFIABLE], "tool_choice": "required"}, "tools"),
    ],
    ids=[
        "no-tools", "unknown-name", "duplicate", "required-format", "auto-format", "custom-tool",
        "legacy-functions", "continue-user", "unsatisfiable-parameters",
    ],
)  # fmt: skip
async def test_tool_request_errors(client: httpx.AsyncClient, extra: dict, param: str) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_continue_final_message_extends_the_assistant_turn(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    messages = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0}
    r = await client.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert r.status_code == 200, r.text
    continued = r.json()["choices"][0]["message"]["content"]
    prompt = tiny_ctx.tokenizer.apply_chat_template(
        [dict(m) for m in messages], continue_final_message=True, tokenize=False
    )
    assert prompt.endswith("The weather in Paris is")  # no end of turn, no new turn
    r = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] == continued
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    r = await client.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


# ---- the official openai client -----------------------------------------------------------------
@pytest.fixture
def oa(tiny_ctx: ServingContext) -> Iterator[openai.OpenAI]:
    with live_server(create_app(ctx=tiny_ctx)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


class Pet(pydantic.BaseModel):
    animal: str = pydantic.Field(json_schema_extra={"enum": ["fox", "dog"]})
    legs: int = pydantic.Field(ge=0, le=8)


def test_openai_client_parse_and_tool_calls(oa: openai.OpenAI) -> None:
    parsed = oa.chat.completions.parse(
        model="tiny", messages=ASK, response_format=Pet, max_tokens=60, temperature=0
    )
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.animal in ("fox", "dog")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        done = oa.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=80,  # type: ignore[arg-type]
            temperature=0,  # sampled, a tiny model may list calls until max_tokens
        )
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls" and message.content is None
        check_calls([c.model_dump() for c in message.tool_calls or []], set(SCHEMAS))
        stream = oa.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=80,
            temperature=0,
            stream=True,
        )
        streamed = [c for ch in stream for d in ch.choices for c in d.delta.tool_calls or []]
        assert streamed and all(c.function and c.function.arguments for c in streamed)
    plain = oa.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=5,  # type: ignore[arg-type]
        temperature=0,
    )
    assert plain.choices[0].message.tool_calls is None
    assert isinstance(plain.choices[0].message.content, str)
    stream = oa.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    chunks = [d for ch in stream for d in ch.choices]
    assert not any(d.delta.tool_calls for d in chunks)
    assert "".join(d.delta.content or "" for d in chunks) == plain.choices[0].message.content
    # a tool round trip: the call and its result go back in; the reply is read as usual
    after = oa.chat.completions.create(
        model="tiny",
        messages=ROUND_TRIP,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
    )
    assert after.choices[0].finish_reason in ("stop", "length")
