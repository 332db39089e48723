"""The official openai SDK (our test extra; in-process), unchanged, against the live server on the
default model: completions, chat, streams, `chat.completions.parse()`, tools, and the Responses
API (`responses.create`: text, a forced function call, `text.format` json_schema;
`responses.parse`; `responses.stream` with `get_final_response()`). Greedy throughout, so a
stream must give exactly the non-streamed text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import record_version
from tests.server_pool import PooledServer

pytestmark = [pytest.mark.clients, pytest.mark.default_model]

HAIKU = "Write a haiku about the sea."
FACTS = "Facts about Tokyo as JSON."
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMS,
    },
}


class CityFacts(BaseModel):
    """Facts about a city."""  # a plain model, as users write them

    city: str
    country: str
    population: int


@pytest.fixture(scope="module")
def oa(served: PooledServer) -> Iterator[openai.OpenAI]:
    record_version("openai", openai.__version__)
    with openai.OpenAI(
        base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300
    ) as client:
        yield client


def check_weather_args(arguments: str) -> None:
    """Valid JSON for the tool's schema, and no key the schema does not name."""
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    assert set(args) <= set(WEATHER_PARAMS["properties"]), args


def test_completions_stream_equals_non_stream(oa: openai.OpenAI, served: PooledServer) -> None:
    body: dict[str, Any] = {"model": served.model, "prompt": "The sea is", "max_tokens": 12}
    done = oa.completions.create(**body, temperature=0)
    choice = done.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert done.usage is not None and 0 < done.usage.completion_tokens <= 12
    chunks = list(
        oa.completions.create(
            **body, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    usage = chunks[-1].usage
    assert usage is not None and done.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        done.usage.prompt_tokens,
        done.usage.completion_tokens,
    )


def test_chat_stream_equals_non_stream(oa: openai.OpenAI, served: PooledServer) -> None:
    messages: Any = [{"role": "user", "content": HAIKU}]
    # Under the int8 CPU default a prompt computed in full and one served from the prefix cache
    # may take different greedy paths at a near-tie (docs/guides/tuning.md): a first request puts
    # the prompt in the cache, so that both compared requests are served alike.
    oa.chat.completions.create(model=served.model, messages=messages, max_tokens=1)
    done = oa.chat.completions.create(
        model=served.model, messages=messages, max_tokens=16, temperature=0
    )
    message = done.choices[0].message
    assert message.role == "assistant" and message.content
    stream = oa.chat.completions.create(
        model=served.model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content
    )
    assert chunks[-1].usage is not None and done.usage is not None
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_chat_parse_fills_a_pydantic_model(oa: openai.OpenAI, served: PooledServer) -> None:
    done = oa.chat.completions.parse(
        model=served.model,
        messages=[{"role": "user", "content": FACTS}],
        response_format=CityFacts,
        max_tokens=200,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, CityFacts)
    assert set(json.loads(choice.message.content or "")) == set(CityFacts.model_fields)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_chat_forced_tool_call_and_its_stream(
    oa: openai.OpenAI, served: PooledServer, tool_choice: Any
) -> None:
    """One call (`parallel_tool_calls: false`; with parallel calls allowed, the 270M model
    repeats its call up to the server's cap of 8 under "required")."""
    body: dict[str, Any] = {
        "model": served.model,
        "messages": WEATHER_ASK,
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 100,
        "temperature": 0,
    }
    done = oa.chat.completions.create(**body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id
    check_weather_args(calls[0].function.arguments)
    deltas = [
        d for c in oa.chat.completions.create(**body, stream=True) for d in c.choices
    ]  # each call arrives whole in one delta when the choice ends
    streamed = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed if tc.function] == [
        (calls[0].function.name, calls[0].function.arguments)
    ]
    assert deltas[-1].finish_reason == "tool_calls"


def test_responses_create_text_equals_chat(oa: openai.OpenAI, served: PooledServer) -> None:
    """The Responses API runs the chat path: same prompt tokens, so the same greedy text."""
    chat = oa.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": HAIKU}],
        max_tokens=16,
        temperature=0,
    )
    response = oa.responses.create(
        model=served.model, input=HAIKU, max_output_tokens=16, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert oa.responses.retrieve(response.id).output_text == response.output_text
    events = list(
        oa.responses.create(
            model=served.model, input=HAIKU, max_output_tokens=16, temperature=0, stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == response.output_text and len(deltas) > 1
    assert events[0].type == "response.created"
    assert events[-1].type == f"response.{response.status}"


def test_responses_forced_function_call(oa: openai.OpenAI, served: PooledServer) -> None:
    response = oa.responses.create(
        model=served.model,
        input="What is the weather in Paris?",
        tools=[
            {
                "type": "function",
                "name": "get_weather",
                "description": "The current weather in a city.",
                "parameters": WEATHER_PARAMS,
                "strict": False,
            }
        ],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=100,
        temperature=0,
    )
    assert response.status == "completed", response
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    check_weather_args(calls[0].arguments)


def test_responses_json_schema_and_parse(oa: openai.OpenAI, served: PooledServer) -> None:
    schema = {**CityFacts.model_json_schema(), "additionalProperties": False}
    response = oa.responses.create(
        model=served.model,
        input=FACTS,
        text={
            "format": {"type": "json_schema", "name": "CityFacts", "schema": schema, "strict": True}
        },
        max_output_tokens=200,
        temperature=0,
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)
    parsed = oa.responses.parse(
        model=served.model,
        input=FACTS,
        text_format=CityFacts,
        max_output_tokens=200,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, CityFacts)
    assert parsed.output_text == response.output_text  # the SDK sends the same strict schema


def test_responses_stream_get_final_response(oa: openai.OpenAI, served: PooledServer) -> None:
    with oa.responses.stream(
        model=served.model,
        input=FACTS,
        text_format=CityFacts,
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text and len(deltas) > 1
    assert isinstance(final.output_parsed, CityFacts)
    assert final.usage is not None and final.usage.output_tokens > 0
