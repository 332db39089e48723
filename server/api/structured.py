"""Structured outputs: a request's `response_format` / `structured_outputs` as a grammar spec,
compiled (off the event loop, cached) into the grammar its engine requests start from.

Chat tool calls that must happen (`tool_choice` "required" or a named function) are constraints
too: server/api/tools.py builds their spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from decoding.grammar import Grammar, GrammarError, GrammarSpec
from server.api.context import ServingContext
from server.api.errors import bad_request
from server.api.protocol import SamplingFields
from server.grammars import GrammarTimeout, StructuredOutputsUnavailable


@dataclass(frozen=True)
class Constraint:
    spec: GrammarSpec
    param: str  # the request field it came from, for errors


def request_constraint(req: SamplingFields) -> Constraint | None:
    """The constraint `response_format` or `structured_outputs` asks for (None: free text)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request(
            "give either response_format or structured_outputs, not both",
            "structured_outputs",
            "conflicting_fields",
        )
    if so is not None:
        if so.json_ is not None:
            return Constraint(
                _schema_spec(so.json_, "structured_outputs.json"), "structured_outputs.json"
            )
        if so.regex is not None:
            return Constraint(GrammarSpec("regex", so.regex), "structured_outputs.regex")
        if so.choice is not None:
            return Constraint(GrammarSpec.choice(so.choice), "structured_outputs.choice")
        assert so.grammar is not None  # exactly one is set (StructuredOutputs checks)
        return Constraint(GrammarSpec("lark", so.grammar), "structured_outputs.grammar")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(GrammarSpec("json_object"), "response_format")
    assert fmt.json_schema is not None  # ResponseFormat checks
    schema = fmt.json_schema.schema_
    param = "response_format.json_schema.schema"
    return Constraint(_schema_spec({} if schema is None else schema, param), param)


def _schema_spec(schema: dict | bool | str, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param, "invalid_schema") from exc
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param, "invalid_schema")
    return GrammarSpec.json_schema(schema)


async def compile_constraint(ctx: ServingContext, constraint: Constraint) -> Grammar:
    """Compile (or find in the cache) a request's constraint; every failure is a 400 naming the
    field it came from."""
    size = len(constraint.spec.source.encode())
    if size > ctx.config.max_grammar_bytes:
        raise bad_request(
            f"{constraint.param} is {size} bytes; this server takes at most "
            f"{ctx.config.max_grammar_bytes}",
            constraint.param,
            "grammar_too_large",
        )
    try:
        return await ctx.grammars.compile(constraint.spec)
    except GrammarError as exc:
        raise bad_request(
            f"{constraint.param} cannot be compiled: {exc}", constraint.param, "invalid_grammar"
        ) from exc
    except GrammarTimeout as exc:
        raise bad_request(
            f"{constraint.param}: {exc}", constraint.param, "grammar_too_complex"
        ) from exc
    except StructuredOutputsUnavailable as exc:
        raise bad_request(
            f"{constraint.param}: structured outputs are not available for this model: {exc}",
            constraint.param,
            "structured_outputs_unavailable",
        ) from exc
