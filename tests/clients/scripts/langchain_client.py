"""langchain-openai's ChatOpenAI, as its users call it, against beamline: with_structured_output
(json_schema, its default, and function_calling), bind_tools with a forced tool, streaming, and
the same over the Responses API (use_responses_api=True). Run by tests/clients/test_langchain.py
under the langchain venv (tests/client_venv.sh langchain).
"""

from __future__ import annotations

from typing import Any

from _report import BASE_URL, MODEL, TIMEOUT_S, Report
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel


class CityFacts(BaseModel):
    """Facts about a city."""

    city: str
    country: str
    population: int


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


FACTS = "Facts about Tokyo as JSON."
WEATHER = "What is the weather in Paris?"
HAIKU = "Write a haiku about the sea."


def llm(max_tokens: int, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=BASE_URL,
        api_key="unused",
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=TIMEOUT_S,
        **kwargs,
    )


def structured(method: str, **kwargs: Any) -> dict[str, Any]:
    runnable = llm(200, **kwargs).with_structured_output(CityFacts, method=method, include_raw=True)
    out = runnable.invoke(FACTS)
    parsed = out["parsed"]
    return {
        "is_instance": isinstance(parsed, CityFacts),
        "value": parsed.model_dump() if isinstance(parsed, BaseModel) else parsed,
        "parsing_error": repr(out["parsing_error"]) if out["parsing_error"] else None,
        "schema": CityFacts.model_json_schema(),
        "finish_reason": out["raw"].response_metadata.get("finish_reason"),
        "status": out["raw"].response_metadata.get("status"),
    }


def bound_tool(**kwargs: Any) -> dict[str, Any]:
    message = (
        llm(100, **kwargs).bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER)
    )
    return {
        "tool_calls": [{"name": c["name"], "args": c["args"]} for c in message.tool_calls],
        "invalid_tool_calls": [dict(c) for c in message.invalid_tool_calls],
        "schema": convert_to_openai_tool(get_weather)["function"]["parameters"],
        "content": message.content,
    }


def text(content: Any) -> str:
    """A message's text: a string (chat completions) or content blocks (Responses API)."""
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


def streamed(**kwargs: Any) -> dict[str, Any]:
    model = llm(16, **kwargs)
    # a first call puts the prompt in the prefix cache, so that the two compared calls are served
    # alike (under the int8 CPU default a cached and an uncached prompt may differ at a near-tie)
    model.invoke(HAIKU)
    whole = model.invoke(HAIKU)
    chunks = list(model.stream(HAIKU))
    return {
        "invoked": text(whole.content),
        "streamed": "".join(text(c.content) for c in chunks),
        "chunks": len(chunks),
        "usage": dict(whole.usage_metadata or {}),
    }


def main() -> None:
    report = Report("langchain-openai", "langchain-core", "openai", "pydantic")
    report.run("structured_json_schema", lambda: structured("json_schema"))
    report.run("structured_function_calling", lambda: structured("function_calling"))
    report.run("bind_tools", bound_tool)
    report.run("stream", streamed)
    responses = {"use_responses_api": True}
    report.run("responses_structured_json_schema", lambda: structured("json_schema", **responses))
    report.run("responses_bind_tools", lambda: bound_tool(**responses))
    report.run("responses_stream", lambda: streamed(**responses))
    report.emit()


if __name__ == "__main__":
    main()
