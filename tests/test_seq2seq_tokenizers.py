"""Encoder-decoder models with their families' own tokenizers: Marian's sentencepiece tokenizer
(two vocabularies, Python only) and T5's sentencepiece Unigram one (a metaspace decoder) serve
completions with `generate()`'s tokens and stream the same text, stop strings cut it, and only
structured outputs answer a 400 that says the grammar engine cannot read the tokenizer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from tests.conftest import started_client
from tests.tiny_seq2seq import build_marian_tokenizer, build_t5_tokenizer, build_tiny_seq2seq

SOURCE = "The quick brown fox jumps over the lazy dog."


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("marian") / "opus-mt-tiny"
    return build_tiny_seq2seq(path, "marian", tokenizer=build_marian_tokenizer())


@pytest.fixture
async def client(marian_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with started_client(marian_dir, "marian") as c:
        yield c


def generated(model_dir: Path, max_new_tokens: int) -> list[int]:
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokenizer(SOURCE).input_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return list(out[0, 1:].tolist())


async def test_marians_sentencepiece_tokenizer_serves_and_streams_the_same_text(
    client: httpx.AsyncClient, marian_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(marian_dir)
    assert type(tokenizer).__name__ == "MarianTokenizer"  # no fast tokenizer exists for it
    body = {"model": "marian", "prompt": SOURCE, "max_tokens": 12, "return_token_ids": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = generated(marian_dir, 12)
    assert choice["token_ids"] == ids
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["prompt_token_ids"] == tokenizer(SOURCE).input_ids
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    text = choice["text"]
    assert len(text) > 6  # a stop string cuts the text where it first starts
    stop = text[4:6]
    cut = await client.post("/v1/completions", json={**body, "stop": [stop]})
    answer = cut.json()["choices"][0]
    assert answer["text"] == text[: text.index(stop)]
    assert answer["finish_reason"] == "stop"


async def test_structured_outputs_on_it_are_a_400_that_says_why(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": "marian", "prompt": SOURCE, "structured_outputs": {"choice": ["a", "b"]}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "structured_outputs_unavailable"
    assert "the grammar engine (llguidance) cannot read its tokenizer" in error["message"]


@pytest.fixture(scope="module")
def t5_unigram_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("t5-unigram") / "t5-tiny"
    # a seed whose greedy output has several words
    return build_tiny_seq2seq(path, "t5", seed=7, tokenizer=build_t5_tokenizer())


async def test_t5s_unigram_tokenizer_serves_streams_and_stops_as_generate_decodes(
    t5_unigram_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(t5_unigram_dir)
    assert type(tokenizer.backend_tokenizer.model).__name__ == "Unigram"
    ids = generated(t5_unigram_dir, 12)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert " " in text.strip()  # the metaspace turned back into spaces, between words
    async with started_client(t5_unigram_dir, "t5") as client:
        body = {"model": "t5", "prompt": SOURCE, "max_tokens": 12, "return_token_ids": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == ids and choice["text"] == text
        assert choice["prompt_token_ids"] == tokenizer(SOURCE).input_ids  # ends in </s>
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [
            json.loads(line[6:])
            for line in streamed.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        stop = text.strip().split(" ")[1]  # the second word: after a space the stream decoded
        cut = await client.post("/v1/completions", json={**body, "stop": [stop]})
        assert cut.json()["choices"][0]["text"] == text[: text.index(stop)]
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        constrained = await client.post(
            "/v1/completions", json={**body, "response_format": json_schema(schema)}
        )
        assert constrained.status_code == 400, constrained.text
        assert constrained.json()["error"]["code"] == "structured_outputs_unavailable"
        assert "can't determine decoder type" in constrained.json()["error"]["message"]
