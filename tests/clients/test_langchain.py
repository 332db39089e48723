"""langchain-openai's ChatOpenAI, unchanged, from its own venv (tests/client_venv.sh langchain:
its pins would move our certifi and orjson): with_structured_output (json_schema, its default,
and function_calling), bind_tools with a forced tool, streaming; and the same over the Responses
API (`use_responses_api=True`). scripts/langchain_client.py runs the client; this file checks
what it got.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from tests.clients.conftest import case, client_python, run_client_script
from tests.server_pool import PooledServer

pytestmark = [pytest.mark.clients, pytest.mark.default_model]


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest) -> dict[str, Any]:
    python = client_python("langchain")  # skips (fails under CI) before the server starts
    served: PooledServer = request.getfixturevalue("served")
    return run_client_script(python, "langchain_client.py", served)


@pytest.mark.parametrize(
    ("name", "ending"),
    [
        ("structured_json_schema", {"finish_reason": "stop"}),
        ("structured_function_calling", {"finish_reason": "tool_calls"}),
        ("responses_structured_json_schema", {"status": "completed"}),
    ],
)
def test_langchain_with_structured_output(
    report: dict[str, Any], name: str, ending: dict[str, str]
) -> None:
    got = case(report, name)
    assert got["is_instance"] and got["parsing_error"] is None, got
    jsonschema.validate(got["value"], got["schema"])
    for key, value in ending.items():
        assert got[key] == value, got


@pytest.mark.parametrize("name", ["bind_tools", "responses_bind_tools"])
def test_langchain_bind_tools_forced_call(report: dict[str, Any], name: str) -> None:
    got = case(report, name)
    assert got["invalid_tool_calls"] == [], got
    assert [c["name"] for c in got["tool_calls"]] == ["get_weather"], got
    args = got["tool_calls"][0]["args"]
    jsonschema.validate(args, got["schema"])
    assert set(args) <= set(got["schema"]["properties"])


@pytest.mark.parametrize("name", ["stream", "responses_stream"])
def test_langchain_stream_equals_invoke(report: dict[str, Any], name: str) -> None:
    """Greedy: the streamed text is the invoked text, in several chunks."""
    got = case(report, name)
    assert got["invoked"] and got["streamed"] == got["invoked"], got
    assert got["chunks"] > 2
    assert got["usage"]["output_tokens"] == 16  # max_tokens, as the server counted it
