"""The OpenAPI document (`/openapi.json`) as the server behaves, where FastAPI's generated one
differs: clients and tools (schemathesis, SDK generators) read it, so it must not lie.

- Errors are 400s in OpenAI's shape (errors.py), never FastAPI's 422 `HTTPValidationError`.
- The generating routes answer `text/event-stream` when asked to stream; `/metrics` answers
  Prometheus' text format.
- `POST /v1/responses` reads its body itself (to name fields as OpenAI's Responses API does), so
  FastAPI sees no body model: the document gets `ResponsesRequest`'s schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from server.api.responses_protocol import ResponsesRequest

STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
PLAIN_TEXT = ("/metrics",)
BODIES: dict[str, type[BaseModel]] = {"/v1/responses": ResponsesRequest}
REF = "#/components/schemas/{model}"
# One server-sent event of a stream: `data` holds a chunk's JSON (or `[DONE]`); the Responses API
# names each event's type too.
SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
ERROR_BODY = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def describe_as_served(app: FastAPI) -> None:
    """Make `app.openapi()` return the corrected document (built once, then cached)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _correct(generate())
        assert app.openapi_schema is not None  # generate() stored the document it built
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def _correct(doc: dict[str, Any]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_BODY
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            if answers.pop("422", None) is not None or "requestBody" in operation:
                answers["400"] = {"description": "Invalid request", "content": error}
            if path in STREAMING:
                content = answers.setdefault("200", {}).setdefault("content", {})
                content["text/event-stream"] = {"schema": SSE_EVENT}
            if path in PLAIN_TEXT:
                answers["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    for path, model in BODIES.items():
        schema = model.model_json_schema(ref_template=REF)
        for name, part in schema.pop("$defs", {}).items():  # chat's shared parts are there
            schemas.setdefault(name, part)
        schemas[model.__name__] = schema
        body = {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}
        post = doc["paths"][path]["post"]
        post["requestBody"] = {"required": True, "content": body}
        post["responses"]["400"] = {"description": "Invalid request", "content": error}
