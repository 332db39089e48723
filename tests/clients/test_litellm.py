"""litellm's OpenAI-compatible provider (`model="openai/<name>"`, `api_base=...`), unchanged, from
its own venv (tests/client_venv.sh litellm: its pins would move our boto3 and certifi): chat,
streaming, a forced tool call, a pydantic response_format and a text completion.
scripts/litellm_client.py runs the client; this file checks what it got.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.clients.conftest import case, client_python, run_client_script
from tests.server_pool import PooledServer

pytestmark = [pytest.mark.clients, pytest.mark.default_model]


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest) -> dict[str, Any]:
    python = client_python("litellm")  # skips (fails under CI) before the server starts
    served: PooledServer = request.getfixturevalue("served")
    return run_client_script(python, "litellm_client.py", served)


def test_litellm_chat_and_stream(report: dict[str, Any]) -> None:
    """Greedy: the streamed text is the non-streamed text; usage arrives with the stream too."""
    got = case(report, "chat_and_stream")
    assert got["content"] and got["streamed"] == got["content"], got
    assert got["finish_reason"] in ("stop", "length")
    assert 0 < got["usage"]["completion_tokens"] <= 16
    stream_usage = got["stream_usage"]
    assert stream_usage is not None, "no usage in the stream (stream_options.include_usage)"
    for key in ("prompt_tokens", "completion_tokens"):
        assert stream_usage[key] == got["usage"][key]


def test_litellm_forced_tool_call(report: dict[str, Any]) -> None:
    got = case(report, "forced_tool")
    assert got["finish_reason"] == "tool_calls" and len(got["tool_calls"]) == 1, got
    call = got["tool_calls"][0]
    assert call["name"] == "get_weather" and call["id"]
    args = json.loads(call["arguments"])
    jsonschema.validate(args, got["schema"])
    assert set(args) <= set(got["schema"]["properties"])


def test_litellm_pydantic_response_format(report: dict[str, Any]) -> None:
    got = case(report, "pydantic_response_format")
    assert got["finish_reason"] == "stop", got
    jsonschema.validate(got["raw"], got["schema"])
    assert set(got["raw"]) == set(got["schema"]["properties"])


def test_litellm_text_completion(report: dict[str, Any]) -> None:
    got = case(report, "text_completion")
    assert got["text"] and got["finish_reason"] in ("stop", "length"), got
    assert 0 < got["usage"]["completion_tokens"] <= 8
