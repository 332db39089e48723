"""The OpenAPI document says what the server does (server/api/openapi.py): tools read it."""

from __future__ import annotations

import httpx


async def test_the_document_declares_what_the_server_answers(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    operations = [op for ops in doc["paths"].values() for op in ops.values()]
    assert all("422" not in op["responses"] for op in operations)  # errors are 400s
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    responses = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
    ref = responses["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "input" in doc["components"]["schemas"][ref]["properties"]
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"type": "null"} in completion["temperature"]["anyOf"]  # null means the default


async def test_an_unknown_field_is_refused_even_as_null(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "foo": None})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("foo", "unknown_field")
    ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": None})
    assert ok.status_code == 200, ok.text
