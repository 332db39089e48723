"""Batch invariance over HTTP: a greedy and a seeded request give the same tokens alone and inside a
batch of 16 concurrent mixed requests (other prompts and lengths, sampling, n, beams, best_of,
chat, stop strings, streaming, a long prompt prefilled in chunks).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from tests.conftest import make_engine, serving_context
from tests.reliability_helpers import engine_stats, sse_payloads, wait_until_idle

TOKENS = 24
GREEDY = {
    "prompt": "The quick brown fox",
    "max_tokens": TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "logprobs": 0,
}
SEEDED = {
    "prompt": "Once upon a time",
    "max_tokens": TOKENS,
    "temperature": 0.8,
    "seed": 1234,
    "ignore_eos": True,
    "logprobs": 0,
}
LONG_PROMPT = "All that glitters is not gold. " * 25  # > the 64-token step budget: chunked prefill

COMPANIONS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "Hello world", "max_tokens": 30, "temperature": 1.0}),
    (
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 12, "temperature": 0.8, "seed": 1234},
    ),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 10, "temperature": 0}),
    ("/v1/completions", {"prompt": "A journey of", "max_tokens": 20, "n": 3, "temperature": 0.9}),
    ("/v1/completions", {"prompt": "To be or not", "max_tokens": 16, "num_beams": 3, "n": 2}),
    ("/v1/completions", {"prompt": "The early bird", "max_tokens": 16, "best_of": 3, "seed": 5}),
    (
        "/v1/completions",
        {"prompt": ["Numbers: 0 1", "Unicode: café"], "max_tokens": 18, "top_k": 5},
    ),
    (
        "/v1/completions",
        {"prompt": "Code: def f(x):", "max_tokens": 40, "stop": ["return", "\n"], "temperature": 0},
    ),
    (
        "/v1/completions",
        {
            "prompt": "Sampling draws",
            "max_tokens": 28,
            "stream": True,
            "top_p": 0.9,
            "repetition_penalty": 1.3,
        },
    ),
    (
        "/v1/completions",
        {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "min_tokens": 4},
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 22},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Beam search?"},
            ],
            "max_tokens": 14,
            "stream": True,
            "temperature": 0,
        },
    ),
    ("/v1/completions", {"prompt": "I am fine", "max_tokens": 1, "temperature": 0}),
    (
        "/v1/completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 26,
            "temperature": 0.8,
            "seed": 99,
            "presence_penalty": 1.0,
            "logit_bias": {"10": 5},
        },
    ),
]
assert len(COMPANIONS) + 2 == 16


@pytest.fixture
async def client(tiny_model_dirs: dict[str, Path]) -> AsyncIterator[httpx.AsyncClient]:
    ctx: ServingContext = serving_context(make_engine(tiny_model_dirs["llama"]))
    transport = httpx.ASGITransport(app=create_app(ctx=ctx), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield c
    finally:
        ctx.engine.shutdown()


def tokens_and_text(r: httpx.Response) -> tuple[list[str], str]:
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert r.json()["usage"]["completion_tokens"] == TOKENS
    return choice["logprobs"]["tokens"], choice["text"]


def check_companion(path: str, body: dict[str, Any], r: httpx.Response) -> None:
    assert r.status_code == 200, (body, r.text)
    if body.get("stream"):
        payloads = sse_payloads(r.text)
        assert payloads[-1] == "[DONE]" and all("error" not in json.loads(p) for p in payloads[:-1])


async def batch(
    client: httpx.AsyncClient, targets_at: int
) -> tuple[httpx.Response, httpx.Response]:
    """The two targets at position `targets_at` among the companions, all sent at once."""
    requests = list(COMPANIONS)
    requests[targets_at:targets_at] = [("/v1/completions", GREEDY), ("/v1/completions", SEEDED)]
    replies = await asyncio.gather(*(client.post(path, json=body) for path, body in requests))
    for (path, body), r in zip(requests, replies):
        if body not in (GREEDY, SEEDED):
            check_companion(path, body, r)
    return replies[targets_at], replies[targets_at + 1]


@pytest.mark.timeout(180)
async def test_greedy_and_seeded_requests_give_the_same_tokens_alone_and_in_a_mixed_batch(
    client: httpx.AsyncClient,
) -> None:
    greedy_alone = tokens_and_text(await client.post("/v1/completions", json=GREEDY))
    seeded_alone = tokens_and_text(await client.post("/v1/completions", json=SEEDED))
    assert (await engine_stats(client))["max_seqs_in_step"] == 1
    for position in (0, len(COMPANIONS)):
        greedy, seeded = await batch(client, position)
        assert tokens_and_text(greedy) == greedy_alone, (
            f"greedy differs in a batch (position {position})"
        )
        assert tokens_and_text(seeded) == seeded_alone, (
            f"seeded differs in a batch (position {position})"
        )
        await wait_until_idle(client, timeout=5)
    assert (await engine_stats(client))["max_seqs_in_step"] >= 8  # they really shared steps


@pytest.mark.timeout(120)
async def test_a_streamed_seeded_request_in_a_batch_streams_the_text_it_gives_alone(
    client: httpx.AsyncClient,
) -> None:
    body = {k: v for k, v in SEEDED.items() if k != "logprobs"}
    alone = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    requests = [("/v1/completions", {**body, "stream": True}), *COMPANIONS]
    replies = await asyncio.gather(*(client.post(path, json=b) for path, b in requests))
    payloads = sse_payloads(replies[0].text)
    assert payloads[-1] == "[DONE]"
    streamed = "".join(c["text"] for p in payloads[:-1] for c in json.loads(p)["choices"])
    assert streamed == alone
    await wait_until_idle(client, timeout=5)
