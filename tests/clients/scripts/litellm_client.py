"""litellm's OpenAI-compatible provider, as its users call it (`model="openai/<name>"`,
`api_base=...`), against beamline: chat, streaming, a forced tool call, a pydantic
response_format and a text completion. Run by tests/clients/test_litellm.py under the litellm
venv (tests/client_venv.sh litellm).
"""

from __future__ import annotations

import os

# Before litellm's import: its price list from the package, not fetched (no network here).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import json  # noqa: E402
from typing import Any  # noqa: E402

import litellm  # noqa: E402
from _report import BASE_URL, MODEL, TIMEOUT_S, Report  # noqa: E402
from pydantic import BaseModel  # noqa: E402

litellm.telemetry = False
ROUTE = {"model": f"openai/{MODEL}", "api_base": BASE_URL, "api_key": "unused"}
COMMON = {**ROUTE, "temperature": 0, "timeout": TIMEOUT_S, "num_retries": 0}
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


class CityFacts(BaseModel):
    city: str
    country: str
    population: int


def chat_and_stream() -> dict[str, Any]:
    whole = litellm.completion(messages=HAIKU, max_tokens=16, **COMMON)
    chunks = list(
        litellm.completion(
            messages=HAIKU,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **COMMON,
        )
    )
    usage = [c.usage.model_dump() for c in chunks if getattr(c, "usage", None)]
    return {
        "content": whole.choices[0].message.content,
        "finish_reason": whole.choices[0].finish_reason,
        "usage": whole.usage.model_dump(),
        "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        "stream_usage": usage[-1] if usage else None,
    }


def forced_tool() -> dict[str, Any]:
    done = litellm.completion(
        messages=WEATHER_ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        **COMMON,
    )
    message = done.choices[0].message
    return {
        "finish_reason": done.choices[0].finish_reason,
        "tool_calls": [
            {"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
            for c in message.tool_calls or []
        ],
        "schema": WEATHER["function"]["parameters"],
    }


def pydantic_response_format() -> dict[str, Any]:
    done = litellm.completion(
        messages=[{"role": "user", "content": "Facts about Tokyo as JSON."}],
        response_format=CityFacts,
        max_tokens=200,
        **COMMON,
    )
    content = done.choices[0].message.content
    facts = CityFacts.model_validate_json(content)
    return {
        "finish_reason": done.choices[0].finish_reason,
        "value": facts.model_dump(),
        "raw": json.loads(content),
        "schema": CityFacts.model_json_schema(),
    }


def text_completion() -> dict[str, Any]:
    done = litellm.text_completion(prompt="The capital of France is", max_tokens=8, **COMMON)
    return {
        "text": done.choices[0].text,
        "finish_reason": done.choices[0].finish_reason,
        "usage": done.usage.model_dump(),
    }


def main() -> None:
    report = Report("litellm", "openai", "pydantic")
    report.run("chat_and_stream", chat_and_stream)
    report.run("forced_tool", forced_tool)
    report.run("pydantic_response_format", pydantic_response_format)
    report.run("text_completion", text_completion)
    report.emit()


if __name__ == "__main__":
    main()
