"""Every decoding strategy inside the continuous batch: HF parity, mixing, sharing, streaming."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from decoding import DecodingParams
from server.api.serving import ServingContext
from tests.conftest import hf_reference, make_engine
from tests.engine_driver import generate, run_to_completion, submit

PROMPTS = ["Hello world! How are you", "The quick brown fox", "Once upon a time there was"]


@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping", "n"),
    [(2, 1.0, False, 1), (4, 0.0, True, 2), (4, -1.0, "never", 3), (8, 2.0, False, 2)],
)
def test_beam_search_in_the_engine_equals_hf_generate(
    llama_dir: Path, num_beams: int, length_penalty: float, early_stopping: bool | str, n: int
) -> None:
    ref, tok = hf_reference(llama_dir)
    engine = make_engine(llama_dir)
    params = DecodingParams(
        max_tokens=10,
        temperature=0,
        num_beams=num_beams,
        n=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    prompts = [tok(p).input_ids for p in PROMPTS]
    got = generate(engine, prompts, params)  # the three beam requests run in the same steps
    for ids, result in zip(prompts, got):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=10,
                num_beams=num_beams,
                num_return_sequences=n,
                do_sample=False,
                length_penalty=length_penalty,
                early_stopping=early_stopping,
            )
        expected = [[t for t in o[len(ids) :].tolist() if t != tok.pad_token_id] for o in out]
        assert [c[1] for c in result.choices().values()] == expected
    assert engine.stats.max_seqs_in_step == 3 * num_beams
    assert engine.pool.num_free == engine.pool.num_blocks


def test_beams_share_the_prompt_blocks_and_prefill_it_once(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, block_size=4, max_num_batched_tokens=256)
    prompt = engine.tokenizer(
        " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    ).input_ids
    generate(engine, [prompt], DecodingParams(max_tokens=8, temperature=0, ignore_eos=True))
    greedy_peak, greedy_tokens = engine.stats.peak_blocks_used, engine.stats.tokens_computed
    engine = make_engine(llama_dir, block_size=4, max_num_batched_tokens=256)
    generate(
        engine, [prompt], DecodingParams(max_tokens=8, temperature=0, num_beams=4, ignore_eos=True)
    )
    # The prompt runs once; afterwards 4 rows decode one token each per step.
    assert engine.stats.tokens_computed <= len(prompt) + 4 * 8
    assert greedy_tokens == len(prompt) + 7
    # Four beams hold the prompt's blocks once, plus their own few tail blocks.
    prompt_blocks = -(-len(prompt) // 4)
    assert engine.stats.peak_blocks_used < prompt_blocks + 4 * 4 < 4 * greedy_peak
    assert engine.pool.num_free == engine.pool.num_blocks


def test_n_samples_fork_from_one_prefill_and_differ(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("Once upon a time").input_ids
    got = generate(engine, [prompt], DecodingParams(max_tokens=12, n=4, seed=7, ignore_eos=True))[0]
    choices = got.choices()
    assert sorted(choices) == [0, 1, 2, 3]
    assert len({tuple(c[1]) for c in choices.values()}) > 1
    assert engine.stats.tokens_computed == len(prompt) + 4 * 11
    again = generate(engine, [prompt], DecodingParams(max_tokens=12, n=4, seed=7, ignore_eos=True))[
        0
    ]
    assert again.choices() == choices  # a seed fixes all n samples


def test_best_of_returns_the_n_most_likely_samples(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("Hello").input_ids
    params = DecodingParams(max_tokens=6, n=2, best_of=5, seed=3, ignore_eos=True, logprobs=0)
    got = generate(engine, [prompt], params)[0]
    choices = got.choices()
    assert sorted(choices) == [0, 1]
    totals = [sum(lp.logprob for lp in o.logprobs) for o in got.outputs]
    assert totals == sorted(totals, reverse=True)
    # The same 5 samples drawn as n=5 contain the two returned, and those are the two most likely.
    all_five = generate(
        engine, [prompt], DecodingParams(max_tokens=6, n=5, seed=3, ignore_eos=True, logprobs=0)
    )[0]
    by_choice = {}
    for o in all_five.outputs:
        text, lps = by_choice.get(o.index, ([], 0.0))
        by_choice[o.index] = (text + o.token_ids, lps + sum(lp.logprob for lp in o.logprobs))
    best = sorted(by_choice.values(), key=lambda v: -v[1])[:2]
    assert [b[0] for b in best] == [c[1] for c in choices.values()]


def test_group_beam_search_runs_in_the_engine(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("The quick brown fox").input_ids
    params = DecodingParams(
        max_tokens=8, temperature=0, num_beams=4, num_beam_groups=2, diversity_penalty=5.0, n=4
    )
    choices = generate(engine, [prompt], params)[0].choices()
    assert len(choices) == 4 and all(c[1] for c in choices.values())
    assert len({tuple(c[1]) for c in choices.values()}) == 4
    assert engine.pool.num_free == engine.pool.num_blocks


MIXED = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "top_p": 0.9, "seed": 11},
    "beam4": {"temperature": 0, "num_beams": 4, "n": 2},
    "group_beam": {
        "temperature": 0,
        "num_beams": 4,
        "num_beam_groups": 2,
        "diversity_penalty": 1.0,
        "n": 2,
    },
    "beam_sample": {"num_beams": 3, "do_sample": True, "seed": 5},
    "best_of": {"n": 2, "best_of": 4, "seed": 9},
}


async def test_six_strategies_at_once_each_equal_their_solo_result(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    async def ask(name: str) -> list[str]:
        body = {"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True, **MIXED[name]}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, (name, r.text)
        return [c["text"] for c in r.json()["choices"]]

    solo = {name: await ask(name) for name in MIXED}
    engine = tiny_ctx.engine.engine
    before = engine.stats.max_seqs_in_step
    together = await asyncio.gather(*(ask(name) for name in MIXED))
    assert dict(zip(MIXED, together)) == solo
    assert engine.stats.max_seqs_in_step > before  # they really shared steps
    assert engine.pool.num_free == engine.pool.num_blocks


def sse_chunks(body: str) -> list[dict]:
    events = [e[len("data: ") :] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_streaming_sampled_choices_interleave_and_beams_arrive_whole(
    client: httpx.AsyncClient,
) -> None:
    # 32 tokens: a consumer that falls behind gets one merged delta per choice
    # (engine/client.py: stream_outputs), so with 6 a busy CI host once saw each choice whole;
    # the choices interleave unless it fell behind for the request's whole run
    sampled = {"prompt": "Hi", "max_tokens": 32, "n": 2, "seed": 1, "ignore_eos": True}
    r = await client.post("/v1/completions", json={**sampled, "stream": True})
    chunks = sse_chunks(r.text)
    indices = [c["choices"][0]["index"] for c in chunks]
    assert set(indices) == {0, 1} and indices != sorted(indices)  # token by token, both choices
    plain = await client.post("/v1/completions", json=sampled)
    streamed = {
        i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
        for i in (0, 1)
    }
    assert streamed == {c["index"]: c["text"] for c in plain.json()["choices"]}

    beam = {"prompt": "Hi", "max_tokens": 6, "num_beams": 3, "n": 3, "temperature": 0}
    r = await client.post("/v1/completions", json={**beam, "stream": True})
    chunks = sse_chunks(r.text)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 2]  # one whole choice each
    assert all(c["choices"][0]["finish_reason"] for c in chunks)
    plain = (await client.post("/v1/completions", json=beam)).json()
    assert [c["choices"][0]["text"] for c in chunks] == [c["text"] for c in plain["choices"]]


async def test_completion_logprobs_shape_and_values(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "Hello",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 3,
        },
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and chosen <= 0  # byte tokens may decode alike and merge
        assert abs(max(top.values()) - chosen) < 1e-5  # greedy picks the most likely token
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


async def test_chat_logprobs_and_beam_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 2
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "Hello",
            "max_tokens": 5,
            "temperature": 0,
            "num_beams": 2,
            "logprobs": 1,
            "ignore_eos": True,
        },
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 5 and all(x <= 0 for x in lp["token_logprobs"])


async def test_echo_prepends_the_prompt(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hello world", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    echoed = (await client.post("/v1/completions", json={**body, "echo": True})).json()["choices"][
        0
    ]["text"]
    assert echoed == "Hello world" + plain
    r = await client.post("/v1/completions", json={**body, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_chunks(r.text)) == echoed


def test_aborting_a_beam_request_frees_every_block(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("Once upon a time there was").input_ids
    beams = submit(
        engine,
        "beams",
        prompt,
        DecodingParams(max_tokens=40, temperature=0, num_beams=4, ignore_eos=True),
    )
    for _ in range(5):
        engine.step()
    engine.abort("beams")
    run_to_completion(engine)
    assert beams.finish_reason == "abort" and beams.finished
    assert engine.pool.num_free == engine.pool.num_blocks
