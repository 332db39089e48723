"""Structured outputs and request-field handling over HTTP (tiny model): every request form,
every error a 400 naming its field, compiles cached and counted."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from server.api.extension_fields import FIELDS
from server.api.serving import ServingContext

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"enum": ["fox", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "maxItems": 2,
        },
    },
    "required": ["animal", "count", "tags"],
    "additionalProperties": False,
}
COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 60}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 60}


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


async def _texts(
    client: httpx.AsyncClient, body: dict, chat: bool = False
) -> list[tuple[str, str]]:
    r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    return [(c["message"]["content"] if chat else c["text"], c["finish_reason"]) for c in choices]


@pytest.mark.parametrize(
    "strategy",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 5, "n": 3},
        {"temperature": 1.0, "seed": 6, "n": 2, "best_of": 3},
        {"num_beams": 3, "n": 3},
        {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5, "n": 2},
    ],
    ids=["greedy", "n", "best_of", "beams", "group_beams"],
)
async def test_json_schema_on_both_endpoints_for_every_strategy(
    client: httpx.AsyncClient, strategy: dict
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    for chat, base in ((False, COMPLETION), (True, CHAT)):
        outputs = await _texts(client, {**base, **strategy, "response_format": fmt}, chat)
        assert len(outputs) == strategy.get("n", 1)
        for text, reason in outputs:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMA)
            assert list(json.loads(text)) == ["animal", "count", "tags"]  # the schema's order


async def test_json_object_regex_choice_and_grammar(client: httpx.AsyncClient) -> None:
    [(text, reason)] = await _texts(
        client, {**COMPLETION, "temperature": 0, "response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(text), dict), (text, reason)
    regex = r"(yes|no), [0-9]{1,3}!"
    [(text, reason)] = await _texts(
        client,
        {**CHAT, "temperature": 0.8, "seed": 1, "structured_outputs": {"regex": regex}},
        True,
    )
    assert reason == "stop" and re.fullmatch(regex, text)
    choices = ["café au lait", "東京", "yes"]
    outputs = await _texts(
        client, {**COMPLETION, "n": 4, "seed": 2, "structured_outputs": {"choice": choices}}
    )
    assert all(reason == "stop" and text in choices for text, reason in outputs)
    lark = 'start: "the " animal " is " ("fast" | "slow")\nanimal: "fox" | "dog"\n'
    [(text, reason)] = await _texts(
        client, {**COMPLETION, "temperature": 0, "structured_outputs": {"grammar": lark}}
    )
    assert reason == "stop" and re.fullmatch(r"the (fox|dog) is (fast|slow)", text)
    [(text, _)] = await _texts(
        client, {**COMPLETION, "max_tokens": 5, "response_format": {"type": "text"}}
    )
    schema_text = json.dumps({"type": "string", "enum": ["a", "b"]})  # vLLM takes schema text
    [(text, reason)] = await _texts(
        client, {**COMPLETION, "structured_outputs": {"json": schema_text}}
    )
    assert reason == "stop" and json.loads(text) in ("a", "b")


async def test_streamed_constrained_choices_join_to_valid_json(client: httpx.AsyncClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    body = {**CHAT, "stream": True, "n": 2, "seed": 3, "response_format": fmt}
    texts = {0: "", 1: ""}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


SO = "structured_outputs"
RF = "response_format"
BAD_CONSTRAINTS = {  # id: (request fields, param, code)
    "bad-schema": (
        {RF: {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no"}}}},
        "response_format.json_schema.schema",
        "invalid_grammar",
    ),
    "schema-missing": ({RF: {"type": "json_schema"}}, RF, "invalid_value"),
    "bad-type": ({RF: {"type": "yaml"}}, "response_format.type", "invalid_value"),
    "bad-regex": ({SO: {"regex": "(a"}}, "structured_outputs.regex", "invalid_grammar"),
    "bad-lark": ({SO: {"grammar": "start: x"}}, "structured_outputs.grammar", "invalid_grammar"),
    "schema-text": ({SO: {"json": "{not json"}}, "structured_outputs.json", "invalid_schema"),
    "empty-choice": ({SO: {"choice": []}}, "structured_outputs.choice", "invalid_grammar"),
    "two-kinds": ({SO: {"regex": "a", "choice": ["a"]}}, SO, "invalid_value"),
    "unknown-kind": (
        {SO: {"json_object": True}},
        "structured_outputs.json_object",
        "unknown_field",
    ),
    "both-fields": ({SO: {"regex": "a"}, RF: {"type": "json_object"}}, SO, "conflicting_fields"),
    "unknown-field": ({"structured_output": {"regex": "a"}}, "structured_output", "unknown_field"),
    "refused-field": (
        {"guided_whitespace_pattern": " *"},
        "guided_whitespace_pattern",
        "unsupported",
    ),
    "guided-bad-regex": ({"guided_regex": "(a"}, "guided_regex", "invalid_grammar"),
    "guided-twice": (
        {"guided_regex": "a", "guided_choice": ["a"]},
        "guided_choice",
        "conflicting_fields",
    ),
    "guided-and-so": ({"guided_regex": "a", SO: {"regex": "a"}}, SO, "conflicting_fields"),
    "suffix": ({"suffix": "tail"}, "suffix", "unsupported"),
    "too-large": ({SO: {"regex": "a" * 300_000}}, "structured_outputs.regex", "grammar_too_large"),
}


@pytest.mark.parametrize(
    ("extra", "param", "code"), list(BAD_CONSTRAINTS.values()), ids=list(BAD_CONSTRAINTS)
)
async def test_bad_constraints_are_400s_naming_the_field(
    client: httpx.AsyncClient, tiny_ctx: ServingContext, extra: dict, param: str, code: str
) -> None:
    r = await client.post("/v1/completions", json={**COMPLETION, **extra})
    error = _error(r)
    assert (error["param"], error["code"]) == (param, code), error
    stats = tiny_ctx.engine.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


async def test_null_means_default_and_ignored_fields_are_accepted(
    client: httpx.AsyncClient,
) -> None:
    nulls = {
        "temperature": None, "top_p": None, "n": None, "stop": None, "seed": None,
        "max_tokens": None, "logit_bias": None, "response_format": None, "tools": None,
        "tool_choice": None, "stream_options": None, "presence_penalty": None,
        "frequency_penalty": None, "logprobs": None, "top_logprobs": None, "user": None,
    }  # fmt: skip
    # a history echoed back as OpenAI's replies carry it: the assistant's refusal is null
    history = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "Again"},
    ]
    body = {**CHAT, **nulls, "messages": history}
    r = await client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    # a null is "the default" only for a field the server has: an unknown one is still named
    error = _error(await client.post("/v1/chat/completions", json={**body, "refusal": None}))
    assert (error["param"], error["code"]) == ("refusal", "unknown_field"), error
    refusing_user = {**CHAT, "messages": [{"role": "user", "content": "Hi", "refusal": "no"}]}
    error = _error(await client.post("/v1/chat/completions", json=refusing_user))
    assert error["param"] == "messages.0.refusal", error
    ignored = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "abc",
        "safety_identifier": "s",
        "prediction": {"type": "content", "content": "x"},
    }
    openai_no_effect = {f.name for f in FIELDS if (f.origin, f.status) == ("OpenAI", "no effect")}
    assert set(ignored) == openai_no_effect - {"stream_options.include_obfuscation"}
    r = await client.post("/v1/chat/completions", json={**CHAT, **ignored, "max_tokens": 3})
    assert r.status_code == 200, r.text
    error = _error(await client.post("/v1/chat/completions", json={**CHAT, "messages": None}))
    assert error["param"] == "messages"
    error = _error(
        await client.post("/v1/chat/completions", json={**CHAT, "web_search_options": {}})
    )
    assert error["param"] == "web_search_options" and "web_search_options" in error["message"]


async def test_compiles_are_cached_and_counted(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    body = {**COMPLETION, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{1,5}"}}
    for _ in range(3):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    await client.post("/v1/completions", json={**body, "structured_outputs": {"regex": "("}})
    metrics = (await client.get("/metrics")).text

    def value(name: str) -> float:
        match = re.search(rf"^beamline:{name}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE)
        assert match, name
        return float(match.group(1))

    assert value("grammar_compiles_total") == 1
    assert value("grammar_cache_hits_total") == 2
    assert value("grammar_compile_failures_total") == 1
    assert value("grammar_compile_seconds_count") == 2
    assert value("grammar_mask_seconds_count") >= 3 * 1  # a mask per constrained step
    stats = tiny_ctx.engine.stats()
    assert stats["constraint_mask_steps"] >= 3
