"""Prompt logprobs (echo + logprobs, prompt_logprobs, max_tokens 0) against transformers' own
forward on the same weights, fp32: short, chunked, partly cached and preempted prompts, under n
and beams; then their API shapes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from decoding import DecodingParams
from server.api.app import create_app
from server.engine.engine import Engine
from server.engine.request import TokenLogprob
from server.model.quantization import RescoredInt8Head
from tests.conftest import hf_reference, make_engine, serving_context
from tests.engine_driver import Collected, run_to_completion, submit

PROMPTS = [
    "Once upon a time there was a little model that served many clients at once, and scored "
    "every prompt it was given.",
    "The quick brown fox jumps over the lazy dog.",
    "To be or not to be, that is the question.",
]
TOP = 3


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` [len, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against(ref: torch.Tensor, ids: list[int], scored: list[TokenLogprob | None]) -> None:
    """Entry j of `scored` is token j's logprob given tokens < j (the first has none)."""
    assert len(scored) == len(ids) and scored[0] is None
    for j in range(1, len(ids)):
        entry = scored[j]
        assert entry is not None and entry.token_id == ids[j]
        dist = ref[j - 1]
        assert abs(entry.logprob - dist[ids[j]].item()) < 1e-4, j
        assert entry.rank == int((dist > dist[ids[j]]).sum()) + 1
        top = dist.topk(len(entry.top))
        assert [t for t, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in entry.top]), top.values, atol=1e-4, rtol=0
        )


def prompt_logprobs_of(got: Collected) -> list[TokenLogprob | None]:
    sent = [o.prompt_logprobs for o in got.outputs if o.prompt_logprobs is not None]
    assert len(sent) == 1, "prompt logprobs come once, with the request's first output"
    assert got.outputs[0].prompt_logprobs is not None
    return sent[0]


@pytest.fixture(scope="module")
def gemma(tiny_model_dirs: dict[str, Path]) -> tuple[Path, torch.nn.Module, object]:
    model, tok = hf_reference(tiny_model_dirs["gemma3"])
    return tiny_model_dirs["gemma3"], model, tok


def encode(tok: object, text: str) -> list[int]:
    return tok(text).input_ids  # type: ignore[operator]


@pytest.mark.parametrize("budget", [512, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_transformers(gemma: tuple, budget: int) -> None:
    """Several prompts at once (one that does not ask beside them), whole or in 7-token chunks,
    the first output token greedy as usual."""
    model_dir, model, tok = gemma
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    prompts = [encode(tok, p) for p in PROMPTS]
    scored = DecodingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    got = [submit(engine, str(i), ids, scored) for i, ids in enumerate(prompts)]
    plain = submit(engine, "plain", prompts[0], DecodingParams(max_tokens=2, temperature=0.0))
    run_to_completion(engine)
    for ids, result in zip(prompts, got):
        ref = reference(model, ids)
        check_against(ref, ids, prompt_logprobs_of(result))
        assert result.token_ids[0] == int(ref[-1].argmax())
    assert all(o.prompt_logprobs is None for o in plain.outputs)
    assert plain.token_ids == got[0].token_ids


def test_prompt_logprobs_under_the_int8_head_are_the_floating_point_heads(gemma: tuple) -> None:
    """An int8 LM head (`int8`: the decoder stays in fp32) scores a prompt from its
    floating-point weight: transformers' logprobs, for the targets outside the candidates it
    re-scores and for the normalizer too, with their ranks and top tokens."""
    model_dir, model, tok = gemma
    engine = make_engine(model_dir, quantization="int8")
    head = engine.runner.lm_head
    assert isinstance(head, RescoredInt8Head) and head.candidates < engine.runner.vocab_size
    prompts = [encode(tok, p) for p in PROMPTS]
    scored = DecodingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    got = [submit(engine, str(i), ids, scored) for i, ids in enumerate(prompts)]
    run_to_completion(engine)
    for ids, result in zip(prompts, got):
        check_against(reference(model, ids), ids, prompt_logprobs_of(result))


@pytest.mark.parametrize("quantization", ["w8a8", "int8-weights"])
def test_prompt_logprobs_under_an_int8_decoder_are_the_floating_point_models(
    gemma: tuple, quantization: str
) -> None:
    """Under an int8 decoder a prompt that scores runs through the floating-point weights:
    transformers' logprobs, ranks and top tokens, chunked, beside requests that do not score.
    Those keep the int8 kernels: each generates what it generates alone, and no hook stays on a
    layer once the steps are done."""
    model_dir, model, tok = gemma
    engine = make_engine(
        model_dir, quantization=quantization, max_num_batched_tokens=16, enable_prefix_caching=False
    )  # every request computes its whole prompt: the plain ones share steps with the scoring
    assert len(engine.runner.exact) > 0
    prompts = [encode(tok, p) for p in PROMPTS]
    greedy = DecodingParams(max_tokens=6, temperature=0.0)
    alone = [submit(engine, f"alone{i}", ids, greedy) for i, ids in enumerate(prompts)]
    run_to_completion(engine)
    scored = DecodingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    got = [submit(engine, str(i), ids, scored) for i, ids in enumerate(prompts)]
    beside = [submit(engine, f"beside{i}", ids, greedy) for i, ids in enumerate(prompts)]
    run_to_completion(engine)
    for ids, result in zip(prompts, got):
        check_against(reference(model, ids), ids, prompt_logprobs_of(result))
    assert [b.token_ids for b in beside] == [a.token_ids for a in alone]
    for layer in engine.runner.exact.weights:
        assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_a_cached_prefix_is_computed_again_where_its_logits_are_needed(gemma: tuple) -> None:
    """A prompt whose prefix is in the prefix cache still gets every logprob right: the cache has
    keys and values, not logits. A scored prompt's blocks (computed at full precision under an
    int8 format) are not a plain request's: the same prompt without scoring takes only the
    blocks a plain request left."""
    model_dir, model, tok = gemma
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    prefix = encode(tok, PROMPTS[0])
    ids = prefix + encode(tok, " And then it stopped.")[1:]
    submit(engine, "warm", prefix, DecodingParams(max_tokens=1, temperature=0.0))
    run_to_completion(engine)
    hits_before = engine.stats.prefix_cache_hits
    got = submit(engine, "scored", ids, DecodingParams(max_tokens=1, prompt_logprobs=0))
    run_to_completion(engine)
    check_against(reference(model, ids), ids, prompt_logprobs_of(got))
    assert engine.stats.prefix_cache_hits == hits_before  # it had to compute from position 0
    again = submit(engine, "again", ids, DecodingParams(max_tokens=1, temperature=0.0))
    run_to_completion(engine)
    assert engine.stats.prefix_cache_hits > hits_before  # the plain prefix's blocks
    block = engine.pool.block_size
    assert again.outputs[-1].cached_tokens == len(prefix) // block * block < len(ids) - block


def test_a_prompt_scored_across_a_preemption_is_still_right(gemma: tuple) -> None:
    """A small pool: the scoring request (the youngest) is preempted mid-prompt and recomputed;
    positions scored before the preemption are not scored twice."""
    model_dir, model, tok = gemma
    engine = make_engine(model_dir, num_blocks=14, block_size=4, max_num_batched_tokens=6)
    long_prompt = encode(tok, PROMPTS[1])
    ids = encode(tok, PROMPTS[0])[:30]
    decoding = submit(
        engine, "decoder", long_prompt, DecodingParams(max_tokens=30, temperature=0.0)
    )
    engine.step()
    scored = submit(engine, "scored", ids, DecodingParams(max_tokens=4, prompt_logprobs=1))
    run_to_completion(engine)
    assert engine.stats.preemptions > 0
    assert decoding.finished and scored.finished
    check_against(reference(model, ids), ids, prompt_logprobs_of(scored))
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(
    "params",
    [
        DecodingParams(max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=2),
        DecodingParams(max_tokens=3, num_beams=3, n=2, prompt_logprobs=2),
        DecodingParams(max_tokens=3, best_of=3, n=1, temperature=1.0, seed=2, prompt_logprobs=2),
    ],
    ids=["n", "beams", "best_of"],
)
def test_prompt_logprobs_under_n_and_beams(gemma: tuple, params: DecodingParams) -> None:
    """A request of several rows scores its prompt once (its rows fork after the prompt)."""
    model_dir, model, tok = gemma
    engine = make_engine(model_dir, max_num_batched_tokens=8)
    ids = encode(tok, PROMPTS[2])
    got = submit(engine, "r", ids, params)
    run_to_completion(engine)
    check_against(reference(model, ids), ids, prompt_logprobs_of(got))
    assert len(got.choices()) == params.n


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(gemma: tuple) -> None:
    model_dir, model, tok = gemma
    engine: Engine = make_engine(model_dir, max_num_batched_tokens=8)
    ids = encode(tok, PROMPTS[1])
    got = submit(engine, "score", ids, DecodingParams(max_tokens=0, prompt_logprobs=0))
    other = submit(engine, "other", ids, DecodingParams(max_tokens=3, temperature=0.0))
    run_to_completion(engine)
    assert got.finished and got.finish_reason == "length"
    assert got.token_ids == [] and got.outputs[-1].completion_tokens == 0
    check_against(reference(model, ids), ids, prompt_logprobs_of(got))
    assert len(other.token_ids) == 3
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.has_work()


# ---- the API ------------------------------------------------------------------------------------
@pytest.fixture
async def gemma_client(gemma: tuple):
    ctx = serving_context(make_engine(gemma[0], max_num_batched_tokens=8), max_logprobs=5)
    app = create_app(ctx=ctx)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        yield c
    ctx.engine.shutdown()


async def test_echo_with_logprobs_returns_the_prompt_tokens_first(
    gemma_client: httpx.AsyncClient, gemma: tuple
) -> None:
    """lm-evaluation-harness' request: echo, logprobs 1, max_tokens 1, token ids in."""
    _, model, tok = gemma
    ids = encode(tok, PROMPTS[1])
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    r = await gemma_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(model, ids)
    for j in range(1, len(ids)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4
        assert len(lp["top_logprobs"][j]) == 1
        assert max(lp["top_logprobs"][j].values()) == pytest.approx(
            ref[j - 1].max().item(), abs=1e-4
        )
    assert lp["tokens"][1] == tok.decode([ids[1]])  # type: ignore[attr-defined]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets[1] == len(lp["tokens"][0])
    assert choice["text"].startswith(tok.decode(ids))  # type: ignore[attr-defined]
    assert "prompt_logprobs" not in choice  # not asked for in vLLM's shape


async def test_max_tokens_zero_with_echo_scores_only(gemma_client: httpx.AsyncClient) -> None:
    body = {"prompt": "The quick brown fox", "echo": True, "logprobs": 0, "max_tokens": 0}
    r = await gemma_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["text"] == "The quick brown fox"
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == out["usage"]["prompt_tokens"]
    assert all(top == {} for top in lp["top_logprobs"][1:])  # logprobs 0: no alternatives


async def test_streamed_echo_logprobs_equal_the_whole_response(
    gemma_client: httpx.AsyncClient,
) -> None:
    body = {"prompt": PROMPTS[2], "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}
    whole = (await gemma_client.post("/v1/completions", json=body)).json()["choices"][0]
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    offsets: list[int] = []
    text = ""
    async with gemma_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"]
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    token_logprobs += choice["logprobs"]["token_logprobs"]
                    offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert token_logprobs == whole["logprobs"]["token_logprobs"]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_prompt_logprobs_field_in_vllm_shape(
    gemma_client: httpx.AsyncClient, gemma: tuple, path: str
) -> None:
    _, model, tok = gemma
    body: dict = {"max_tokens": 1, "prompt_logprobs": 2}
    if path == "/v1/completions":
        body["prompt"] = PROMPTS[1]
    else:
        body["messages"] = [{"role": "user", "content": "Hi there"}]
    r = await gemma_client.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    scored = (
        out["choices"][0]["prompt_logprobs"]
        if path == "/v1/completions"
        else out["prompt_logprobs"]
    )
    tokenized = await gemma_client.post(
        "/tokenize",
        json={"prompt": PROMPTS[1]}
        if path == "/v1/completions"
        else {"messages": body["messages"]},
    )
    ids = tokenized.json()["tokens"]
    assert len(scored) == len(ids) == out["usage"]["prompt_tokens"]
    assert scored[0] is None
    ref = reference(model, ids)
    for j in range(1, len(ids)):
        entry = scored[j]
        own = entry[str(ids[j])]
        assert abs(own["logprob"] - ref[j - 1, ids[j]].item()) < 1e-4
        assert own["rank"] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        assert own["decoded_token"] == tok.decode([ids[j]])  # type: ignore[attr-defined]
        best = ref[j - 1].topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
        assert set(entry) == {str(ids[j]), *map(str, best)}


async def test_prompt_logprobs_have_a_length_cap(gemma: tuple) -> None:
    ctx = serving_context(make_engine(gemma[0]), max_scored_prompt_tokens=8)
    app = create_app(ctx=ctx)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as c:
            for body in (
                {"prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 0},
                {"prompt": PROMPTS[0], "max_tokens": 1, "echo": True, "logprobs": 0},
            ):
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 400
                assert r.json()["error"]["code"] == "above_limit"
                assert r.json()["error"]["param"] == "prompt"
            r = await c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1})
            assert r.status_code == 200  # no scoring: no cap
    finally:
        ctx.engine.shutdown()
