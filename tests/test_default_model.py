"""End-to-end on the default model (Gemma 3 270M from the PyPI package): greedy parity with HF,
and returned logprobs under its int8 LM head."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding import DecodingParams
from server.api.app import create_app
from server.api.serving import ServingContext
from server.model.loader import resolve_model_dir
from tests.conftest import make_engine, serving_context
from tests.engine_driver import run_to_completion, submit

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
def hf(model_dir: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    """Hugging Face `generate()` greedy continuation of `ids` (stops at the model's EOS ids)."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
    return gen[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def expected(hf: tuple[torch.nn.Module, object]) -> list[list[int]]:
    model, tok = hf
    return [hf_greedy(model, tok(p).input_ids, NEW_TOKENS) for p in PROMPTS]


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


# Gemma 3's turn format, written out by hand (the tokenizer turns the markers into single ids).
GEMMA_TURNS = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


async def test_chat_uses_the_gemma_turn_template(
    ctx: ServingContext, hf: tuple[torch.nn.Module, object]
) -> None:
    question = "What is the capital of France?"
    model, tok = hf
    prompt_ids = tok(GEMMA_TURNS.format(question)).input_ids  # <bos> first
    assert prompt_ids[0] == tok.bos_token_id
    assert tok.convert_ids_to_tokens(prompt_ids[1]) == "<start_of_turn>"
    reply_ids = hf_greedy(model, prompt_ids, 16)
    app = create_app(ctx=ctx)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
    ) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    # The server formatted the question exactly as the turn template does ...
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    # ... and its greedy reply is HF's greedy continuation of those ids, token for token.
    assert body["usage"]["completion_tokens"] == len(reply_ids)
    assert choice["message"] == {
        "role": "assistant",
        "content": tok.decode(reply_ids, skip_special_tokens=True),
    }
    eos = model.generation_config.eos_token_id
    stopped = reply_ids[-1] in (eos if isinstance(eos, list) else [eos])
    assert choice["finish_reason"] == ("stop" if stopped else "length")


async def test_a_prompt_that_starts_with_bos_gets_no_second_one(ctx: ServingContext) -> None:
    """Clients that build prompts themselves (lm-evaluation-harness) send Gemma's <bos>."""
    tok = ctx.tokenizer
    app = create_app(ctx=ctx)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
    ) as client:
        counts = {}
        for prompt in ("Hi", "<bos>Hi"):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            counts[prompt] = r.json()["usage"]["prompt_tokens"]
            tokenized = await client.post("/tokenize", json={"prompt": prompt})
            assert tokenized.json()["tokens"] == [tok.bos_token_id, *tok.encode("Hi")[1:]]
        info = (await client.get("/tokenizer_info")).json()
    assert counts == {"Hi": 2, "<bos>Hi": 2}
    assert tok("<bos>Hi").input_ids[:2] == [tok.bos_token_id] * 2  # the tokenizer alone doubles it
    assert info["add_bos_token"] is True and info["bos_token"] == "<bos>"


@pytest.mark.parametrize("drafts", [0, 4], ids=["plain", "speculating"])
def test_returned_logprobs_under_the_int8_head_are_the_floating_point_heads(
    model_dir: Path, hf: tuple[torch.nn.Module, object], drafts: int
) -> None:
    """Generated tokens' logprobs and their top alternatives under an int8 LM head (`int8`:
    the decoder in fp32): every logit of the rows that return them comes from the
    floating-point weight, so they are transformers' (the int8 tail of the softmax's normalizer
    moved them by up to about 0.08 before). With n-gram drafts, every verified position's too.
    A request beside them that asks for none generates what it generates alone."""
    model, tok = hf
    engine = make_engine(
        model_dir, num_blocks=256, block_size=16, quantization="int8", speculative_tokens=drafts
    )
    prompts = [tok(p * 2).input_ids for p in PROMPTS[:4]]
    greedy = DecodingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    alone = submit(engine, "alone", prompts[0], greedy)
    run_to_completion(engine)
    asks = DecodingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=3)
    got = [submit(engine, str(i), ids, asks) for i, ids in enumerate(prompts)]
    beside = submit(engine, "beside", prompts[0], greedy)
    run_to_completion(engine)
    worst = 0.0
    for ids, result in zip(prompts, got, strict=True):
        returned = [lp for o in result.outputs for lp in o.logprobs or []]
        whole = ids + result.token_ids
        with torch.no_grad():
            ref = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        assert len(returned) == len(result.token_ids) > 0
        for j, entry in enumerate(returned):
            dist = ref[len(ids) + j - 1]
            assert entry.token_id == whole[len(ids) + j]
            top = dist.topk(3)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            ours = torch.tensor([entry.logprob, *(lp for _, lp in entry.top)])
            theirs = torch.cat([dist[entry.token_id : entry.token_id + 1], top.values])
            worst = max(worst, float((ours - theirs).abs().max()))
    print(f"largest logprob difference: {worst:.1e}")
    assert worst < 1e-3
    assert beside.token_ids == alone.token_ids
    if drafts:
        assert engine.stats.spec_accepted_tokens > 0
