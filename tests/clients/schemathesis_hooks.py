"""Schemathesis hooks for tests/clients/test_schemathesis.py, loaded by `st run` in its own venv
(SCHEMATHESIS_HOOKS=schemathesis_hooks, this folder on PYTHONPATH): imports only schemathesis
and the standard library, never beamline.

Two checks OpenAPI alone cannot state:
- every 4xx / 5xx answer is OpenAI's error body `{"error": {"message", "type", "param", "code"}}`
  (what every OpenAI client parses);
- a status is one the document declares, or a 4xx (the document cannot list every refusal; the
  error body check still holds it to OpenAI's shape).
And one hook that keeps generated requests cheap and lets them reach generation: lengths are
capped; schema-valid cases name the served model (another name is a 404 before any generation),
get the content / prompt the server requires beyond what the document says, and a quarter of
them stream (server-sent events, which hypothesis alone seldom reaches).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis

MAX_NEW_TOKENS = int(os.environ.get("BEAMLINE_ST_MAX_TOKENS", "8"))
SERVED_MODEL = os.environ.get("BEAMLINE_ST_MODEL", "")
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
ERROR_FIELDS = {"message": (str,), "type": (str,), "param": (str, type(None))}


def _error_body_problem(text: str) -> str | None:
    """Why `text` is not OpenAI's error body, or None when it is."""
    try:
        body = json.loads(text)
    except ValueError:
        return "the body is not JSON"
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return 'the body has no "error" object'
    error = body["error"]
    missing = [k for k in (*ERROR_FIELDS, "code") if k not in error]
    if missing:
        return f"error lacks {missing}"
    for key, types in ERROR_FIELDS.items():
        if not isinstance(error[key], types):
            return f"error.{key} is {type(error[key]).__name__}"
    if not error["message"]:
        return "error.message is empty"
    if not isinstance(error["code"], (str, int, type(None))):
        return f"error.code is {type(error['code']).__name__}"
    return None


@schemathesis.check
def openai_error_body(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx / 5xx carries OpenAI's error body."""
    if response.status_code < 400:
        return
    problem = _error_body_problem(response.text)
    if problem is not None:
        raise AssertionError(
            f"{response.status_code} is not OpenAI's error body: {problem}: {response.text[:300]!r}"
        )


def _declared(status: int, declared: tuple[str, ...]) -> bool:
    for code in declared:
        code = str(code).upper()
        if code == "DEFAULT" or code == str(status):
            return True
        if len(code) == 3 and code.endswith("XX") and code[0] == str(status)[0]:
            return True
    return False


@schemathesis.check
def documented_status_or_openai_4xx(ctx: Any, response: Any, case: Any) -> None:
    """A status the document declares, or a 4xx (whose body openai_error_body checks)."""
    status = response.status_code
    declared = tuple(case.operation.responses.status_codes)
    if 400 <= status < 500 or _declared(status, declared):
        return
    raise AssertionError(f"status {status} is neither declared ({', '.join(declared)}) nor a 4xx")


def _fill_empty_inputs(body: dict[str, Any]) -> None:
    """Give a schema-valid case the inputs the server requires beyond the document (a message's
    content, a non-empty prompt), so that it reaches generation instead of a 400."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("content") in (None, "", []):
                if not message.get("tool_calls"):
                    message["content"] = "Hi"
    if body.get("prompt") in ("", [], [""], [[]]):
        body["prompt"] = "Hi"
    if body.get("input") in ("", []):
        body["input"] = "Hi"


@schemathesis.hook
def map_case(ctx: Any, case: Any) -> Any:
    """Cheap generations: lengths capped. Schema-valid cases name the served model, carry the
    inputs the server requires beyond the document (the documented rules), and some stream."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for field in LENGTH_FIELDS:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS:
            body[field] = MAX_NEW_TOKENS
    meta = getattr(case, "meta", None)
    if meta is not None and meta.generation.mode.is_positive:
        if SERVED_MODEL and isinstance(body.get("model"), str):
            body["model"] = SERVED_MODEL
        if not any(body.get(f) is not None for f in LENGTH_FIELDS):  # else the server's default
            if "messages" in body:
                body["max_tokens"] = MAX_NEW_TOKENS
            elif "input" in body:
                body["max_output_tokens"] = MAX_NEW_TOKENS
        _fill_empty_inputs(body)
        # Hypothesis rarely draws `stream: true` together with an otherwise valid body: a
        # quarter of the valid generation cases (by their content, so runs repeat) stream.
        generates = any(k in body for k in ("messages", "prompt", "input"))
        if generates and zlib.crc32(repr(body).encode()) % 4 == 0:
            body["stream"] = True
    return case
