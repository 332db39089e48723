"""instructor, as its users call it, against beamline: one pydantic model extracted in each of
Mode.JSON_SCHEMA, Mode.TOOLS and Mode.JSON. Run by tests/clients/test_instructor.py under the
instructor venv (tests/client_venv.sh instructor); `max_retries=0`: the first answer must
validate, no re-asking.
"""

from __future__ import annotations

import json
from typing import Any

import instructor
import openai
from _report import BASE_URL, MODEL, TIMEOUT_S, Report
from instructor.core.exceptions import InstructorRetryException
from pydantic import BaseModel


class CityFacts(BaseModel):
    """Facts about a city."""  # a plain model, as users write them: no bounds, no extras rule

    city: str
    country: str
    population: int


ASK = [{"role": "user", "content": "Facts about Tokyo as JSON."}]
SENT: list[dict[str, Any]] = []


def remember(request: Any) -> None:
    """What instructor put on the wire (the mode decides it), for the test to check."""
    if request.method == "POST":
        SENT.append(json.loads(request.content or b"{}"))


def extract(mode: instructor.Mode) -> dict[str, Any]:
    SENT.clear()
    # openai's own client class (httpx or, in openai 3, httpx2), with a hook that logs bodies
    http = openai.DefaultHttpxClient(event_hooks={"request": [remember]}, timeout=TIMEOUT_S)
    raw = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, http_client=http)
    client = instructor.from_openai(raw, mode=mode)
    out: dict[str, Any] = {"schema": CityFacts.model_json_schema()}
    try:
        facts, completion = client.chat.completions.create_with_completion(
            model=MODEL,
            response_model=CityFacts,
            messages=ASK,
            max_tokens=200,
            temperature=0,
            max_retries=0,
        )
        out |= {"validated": isinstance(facts, CityFacts), "value": facts.model_dump()}
    except InstructorRetryException as exc:  # the reply did not validate: keep what came back
        completion = exc.last_completion
        out |= {"validated": False, "validation_error": str(exc)[-2000:]}
    choice = completion.choices[0]
    sent = SENT[-1]
    return out | {
        "requests": len(SENT),
        "finish_reason": choice.finish_reason,
        "content": choice.message.content,
        "tool_calls": [c.function.arguments for c in choice.message.tool_calls or []],
        "sent": {k: sent.get(k) for k in ("response_format", "tools", "tool_choice")},
    }


def main() -> None:
    report = Report("instructor", "openai", "pydantic")
    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS, instructor.Mode.JSON):
        report.run(mode.name, lambda mode=mode: extract(mode))
    report.emit()


if __name__ == "__main__":
    main()
