"""N-gram speculation: the same tokens as without it, fewer steps, every KV block back.

Greedy rows must be token-identical with speculation on and off; seeded sampled rows too (their
i-th output token uses the i-th number of their random stream either way), and the verification
rule keeps the model's distribution (chi-square below). The tiny random model repeats itself, so
its rows draft, and both accepted and rejected drafts occur.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch

from decoding import DecodingParams
from decoding.grammar import GrammarCompiler, GrammarSpec
from decoding.random_streams import stream_key
from decoding.speculation import DraftLength, NgramIndex, accepted_length
from server.api.app import create_app
from server.config import ServerConfig
from server.engine.engine import Engine
from server.engine.request import EngineRequest, Sequence
from server.engine.speculation import VerifyBatch
from server.engine.work import WorkItem
from tests.conftest import make_engine, serving_context
from tests.engine_driver import Collected, generate, run_to_completion, submit
from tests.test_constrained_decoding import submit as submit_constrained
from tests.test_engine_correctness import hf_greedy
from tests.test_metrics_wiring import samples
from tests.test_overlap_outputs import PROMPTS, free_run_text

K = 4
# prompts the tiny random model continues by repeating itself (most drafts accepted)
LOOPING = ["the cat the cat the cat", "la la la la la la", "fox, dog, bird, fox, dog, bird"]
LIST_REGEX = r"(fox|dog|bird)(, (fox|dog|bird)){6,12}!"  # long enough to repeat itself


# ---- the pure parts -----------------------------------------------------------------------------
def test_the_index_proposes_what_followed_the_last_earlier_occurrence() -> None:
    index = NgramIndex()
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7]
    assert index.propose(tokens, 3) == [8, 9, 1]  # "6 7" occurred at 1..2
    tokens += [3, 6, 7]
    assert index.propose(tokens, 3) == [3, 6, 7]  # the later occurrence wins (kept up to date)
    assert index.propose([*tokens, 8, 9], 2) == [1, 2]
    assert index.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert NgramIndex().propose([1, 2, 1, 2], 0) == []
    # the longest n-gram first: "1 2 3" points elsewhere than "2 3"
    assert NgramIndex().propose([1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3], 1) == [9]
    assert NgramIndex().propose([4, 2, 3, 8, 1, 2, 3], 2) == [8, 1]
    assert NgramIndex().propose([7, 7, 7], 5) == [7]  # the continuation stops at the end


def test_accepted_length_counts_leading_agreements() -> None:
    assert accepted_length([4, 5, 6], [4, 5]) == 2
    assert accepted_length([4, 9, 6], [4, 5]) == 1
    assert accepted_length([1], []) == 0


def test_draft_length_adapts_and_pauses_a_row_whose_drafts_gain_little() -> None:
    length = DraftLength(max_len=8, min_gain=0.5, warm_up=3, pause=5)
    assert length.drafts_now() and length.length == 8  # a fresh row drafts all it may
    length.record(8, 2)
    assert length.length == 3  # most were rejected: the kept run and one more
    length.record(3, 3)
    assert length.length == 6  # all kept: it doubles (up to max_len)
    length.record(6, 6)
    assert length.length == 8 and length.drafts_now()
    for _ in range(5):
        length.record(1, 0)
    assert length.drafts_now()  # the recent gain (a moving average) is not below 0.5 yet
    length.record(1, 0)
    assert [length.drafts_now() for _ in range(6)] == [False] * 5 + [True]  # paused, then retried
    assert length.length == 1 and length.drafted == 23 and length.accepted == 11


# ---- inside the engine --------------------------------------------------------------------------
def workload(engine: Engine) -> list[tuple[list[int], DecodingParams]]:
    """Greedy (with stop strings, logprobs, short max_tokens), seeded sampling with and without
    penalties, n and best_of (seeded, drafting row by row), unconstrained beams."""
    tok = engine.tokenizer
    work = []
    for i, text in enumerate(PROMPTS + LOOPING):
        prompt = tok(text).input_ids
        free = free_run_text(engine, prompt)
        needle = free[len(free) // 2 : len(free) // 2 + 2]
        stop = (needle,) if needle.strip() else ()
        work += [
            (prompt, DecodingParams(max_tokens=40, temperature=0.0)),
            (prompt, DecodingParams(max_tokens=40, temperature=0.0, stop=stop)),
            (prompt, DecodingParams(max_tokens=3 + i, temperature=0.0, logprobs=2)),
            (prompt, DecodingParams(max_tokens=30, temperature=0.3, seed=i, logprobs=1)),
            (
                prompt,
                DecodingParams(
                    max_tokens=30,
                    temperature=0.8,
                    top_k=20,
                    top_p=0.9,
                    repetition_penalty=1.1,
                    presence_penalty=0.2,
                    seed=10 + i,
                ),
            ),
            (prompt, DecodingParams(max_tokens=20, temperature=0.7, seed=i, n=2)),
            (prompt, DecodingParams(max_tokens=12, temperature=0.8, seed=i, best_of=3, n=2)),
            (prompt, DecodingParams(max_tokens=10, temperature=0.0, num_beams=3)),
        ]
    return work


def outputs(got: Collected) -> list[tuple[object, ...]]:
    """Everything a client sees, output by output of each choice (a row that keeps drafts
    streams several tokens in one step, so its siblings' outputs interleave differently); logprobs
    to 1e-3 (a verified position's logits come from a chunk's forward, a decoded one's from a
    one-token step: the float32 sums differ in the last bits)."""
    return [
        (
            o.index,
            o.text,
            o.token_ids,
            o.finish_reason,
            o.completion_tokens,
            [(t.token_id, pytest.approx(t.logprob, abs=1e-3)) for t in o.logprobs or []],
        )
        for o in sorted(got.outputs, key=lambda o: o.index)  # stable: each choice in order
    ]


def run(engine: Engine, work: list[tuple[list[int], DecodingParams]]) -> list[Collected]:
    got = [submit(engine, str(i), prompt, params) for i, (prompt, params) in enumerate(work)]
    run_to_completion(engine)
    return got


def assert_all_blocks_back(engine: Engine) -> None:
    assert not engine.scheduler.has_work() and not engine.output.has_pending
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_speculation_changes_no_output_of_a_mixed_batch(llama_dir: Path, overlap: bool) -> None:
    work = workload(make_engine(llama_dir))
    plain = make_engine(llama_dir, max_num_seqs=128, max_num_batched_tokens=512)
    spec = make_engine(
        llama_dir,
        max_num_seqs=128,
        max_num_batched_tokens=512,
        speculative_tokens=K,
        overlap_outputs=overlap,
    )
    expected, got = run(plain, work), run(spec, work)
    for want, have, (_, params) in zip(expected, got, work):
        assert have.finished
        assert outputs(have) == outputs(want), params
    stats = spec.stats_snapshot()
    drafted, accepted = (
        stats["spec_decode_num_draft_tokens"],
        stats["spec_decode_num_accepted_tokens"],
    )
    assert 0 < accepted < drafted  # drafts were kept and drafts were rejected
    assert spec.stats.tokens_generated == plain.stats.tokens_generated
    stopped = [g for g, (_, p) in zip(got, work) if p.stop and g.finish_reason == "stop"]
    assert len(stopped) >= 3
    for engine in (plain, spec):
        assert_all_blocks_back(engine)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral"])
def test_greedy_tokens_with_speculation_equal_hf_generate(
    arch: str, tiny_model_dirs: dict[str, Path]
) -> None:
    """Verified chunks attend like prefill chunks (sliding windows, softcapping included): the
    tokens are HF's, alone and in a batch."""
    model_dir = tiny_model_dirs[arch]
    texts = [*LOOPING, *PROMPTS[:3]]
    expected = [hf_greedy(model_dir, text, 40) for text in texts]
    engine = make_engine(model_dir, speculative_tokens=K, max_num_batched_tokens=32)
    prompts = [engine.tokenizer(text).input_ids for text in texts]
    params = DecodingParams(max_tokens=40, temperature=0)
    assert [r.token_ids for r in generate(engine, prompts, params)] == expected
    assert generate(engine, prompts[:1], params)[0].token_ids == expected[0]
    assert engine.stats_snapshot()["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_back(engine)


def test_greedy_rows_alone_accept_most_drafts_and_take_fewer_steps(llama_dir: Path) -> None:
    """A row that repeats itself: every draft after the first repeats is verified at once."""
    steps = []
    for k in (0, K):
        engine = make_engine(llama_dir, speculative_tokens=k)
        prompt = engine.tokenizer(LOOPING[0]).input_ids
        got = submit(engine, "r", prompt, DecodingParams(max_tokens=60, temperature=0.0))
        run_to_completion(engine)
        steps.append((engine.stats.steps, got.token_ids))
        assert_all_blocks_back(engine)
    assert steps[1][1] == steps[0][1]
    assert steps[0][0] == 60 and steps[1][0] <= 40


def test_prefix_caching_and_preemption_with_speculation(llama_dir: Path) -> None:
    """Blocks a verified row filled are offered to the prefix cache only with accepted tokens in
    them; a pool too small for the batch preempts and recomputes, drafts never cause it."""
    work = [(p, d) for p, d in workload(make_engine(llama_dir)) if d.num_beams == 1][:24]
    roomy = run(make_engine(llama_dir, max_num_seqs=64), work)
    tight = make_engine(llama_dir, num_blocks=48, max_num_seqs=64, speculative_tokens=K)
    again = [(p, d) for p, d in work if d.max_tokens >= 30]
    got = run(tight, work + again)
    for want, have in zip(roomy + [roomy[work.index(w)] for w in again], got):
        assert outputs(have) == outputs(want)
    assert tight.stats.preemptions > 0
    assert tight.stats.prefix_cache_hits > 0
    assert tight.stats_snapshot()["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_back(tight)


def assert_constrained_rows_unchanged(plain: Engine, drafting: Engine) -> None:
    """A greedy and a seeded row under a regex: the same choices from both engines, each a
    match, and the drafting engine drafted."""
    tok = plain.tokenizer
    compiler = GrammarCompiler(tok, len(tok), plain.eos_token_ids)
    grammar = compiler.compile(GrammarSpec("regex", LIST_REGEX))
    prompt = tok("fox, dog, bird, fox, dog, bird, fox! dog, bird, fox, dog, cat").input_ids
    params = [
        DecodingParams(max_tokens=40, temperature=0.0),
        DecodingParams(max_tokens=40, temperature=0.5, seed=1),
    ]
    results = []
    for engine in (plain, drafting):
        got = [submit_constrained(engine, str(i), prompt, p, grammar) for i, p in enumerate(params)]
        run_to_completion(engine)
        results.append([g.choices() for g in got])
        assert_all_blocks_back(engine)
    assert results[0] == results[1]
    for choices in results[1]:
        assert re.fullmatch(LIST_REGEX, choices[0][0]), choices
    assert drafting.stats_snapshot()["spec_decode_num_draft_tokens"] > 0


def test_constrained_rows_draft_only_what_their_grammar_allows(llama_dir: Path) -> None:
    assert_constrained_rows_unchanged(
        make_engine(llama_dir), make_engine(llama_dir, speculative_tokens=K)
    )


def test_beam_rows_never_draft_and_seeded_multi_row_requests_draft_the_same_tokens(
    llama_dir: Path,
) -> None:
    """Beam rows never draft. The rows of a seeded n / best_of request do (each row has a random
    stream of its own) and give the tokens they give without speculation."""
    engine = make_engine(llama_dir, speculative_tokens=K)
    prompt = engine.tokenizer(LOOPING[0]).input_ids
    submit(engine, "b", prompt, DecodingParams(max_tokens=30, num_beams=2, temperature=0.0))
    run_to_completion(engine)
    assert engine.stats_snapshot()["spec_decode_num_drafts"] == 0
    work = [
        (prompt, DecodingParams(max_tokens=30, temperature=0.5, n=3, seed=3)),
        (prompt, DecodingParams(max_tokens=20, temperature=0.8, best_of=3, n=2, seed=4)),
    ]
    plain, spec = make_engine(llama_dir), make_engine(llama_dir, speculative_tokens=K)
    expected, got = run(plain, work), run(spec, work)
    assert [outputs(g) for g in got] == [outputs(g) for g in expected]
    assert len({tuple(o.token_ids) for o in got[0].outputs}) > 1  # the rows' streams differ
    assert spec.stats_snapshot()["spec_decode_num_drafts"] > 0
    assert_all_blocks_back(spec)


def test_drafts_fit_the_step_budget(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, speculative_tokens=8, max_num_batched_tokens=6)
    seen: list[int] = []
    execute = engine.runner.execute

    def counting(plan):  # type: ignore[no-untyped-def]
        seen.append(plan.num_tokens)
        return execute(plan)

    engine.runner.execute = counting  # type: ignore[method-assign]
    prompts = [engine.tokenizer(p).input_ids for p in LOOPING]
    for i, p in enumerate(prompts):
        submit(engine, str(i), p, DecodingParams(max_tokens=40, temperature=0.0))
    run_to_completion(engine)
    assert max(seen) <= 6
    assert engine.stats_snapshot()["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_back(engine)


def test_on_by_default_and_off_by_the_switch(llama_dir: Path) -> None:
    assert ServerConfig().num_speculative_tokens == 8
    assert ServerConfig(num_speculative_tokens=0).num_speculative_tokens == 0
    off = make_engine(llama_dir, speculative_tokens=0)
    prompt = off.tokenizer(LOOPING[0]).input_ids
    submit(off, "r", prompt, DecodingParams(max_tokens=40, temperature=0.0))
    run_to_completion(off)
    assert off.stats_snapshot()["spec_decode_num_drafts"] == 0


async def test_drafted_and_accepted_tokens_in_metrics_and_stats(llama_dir: Path) -> None:
    ctx = serving_context(make_engine(llama_dir, speculative_tokens=K))
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": LOOPING[0], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 40
            m = samples((await client.get("/metrics")).text)
            stats = (await client.get("/v1/engine/stats")).json()
    finally:
        ctx.engine.shutdown()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert m[(f"beamline:spec_decode_{name}_total", ())] == stats[f"spec_decode_{name}"] > 0
    assert m[("beamline:generation_tokens_total", ())] == 40


# ---- the rule keeps the distribution ------------------------------------------------------------
def test_verification_keeps_a_sampled_rows_distribution() -> None:
    """One sampled row with one draft over a vocabulary of 6: the kept first token follows the
    model's p (chi-square), the draft is kept with probability p(draft), and a rejected draft is
    replaced by a token drawn from p without it."""
    torch.manual_seed(0)
    vocab, draft = 6, 2
    p = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.2, 0.1])
    logits = torch.stack([p.log(), torch.zeros(vocab)])  # position 0, and after the draft
    req = EngineRequest("r", [1], DecodingParams(max_tokens=8, temperature=1.0), lambda o: None)
    req.prepare(frozenset({99}), torch.device("cpu"), 64)
    seq = req.rows[0]
    seq.token_ids.append(4)  # one output token: the row decodes
    trials, first, kept = 6000, torch.zeros(vocab), 0
    for trial in range(trials):
        req.stream_key = stream_key(trial)  # a fresh stream: the same one would draw the same
        item = WorkItem(seq, 1 + 1, draft=[draft])
        batch = VerifyBatch([item], [seq], None)
        pending, _ = batch.choose(logits, frozenset({99}))
        choices = pending.read()
        outcome = batch.outcome(0, choices)
        first[outcome.tokens[0]] += 1
        kept += outcome.accepted
    expected = p * trials
    chi2 = float(((first - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # df = 5: p < 0.001
    assert abs(kept / trials - float(p[draft])) < 0.03
    assert isinstance(seq, Sequence)


def test_kept_penalty_histories_change_no_output(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows keep their penalty state between steps (decoding/penalty_table.py, updated by every
    commit): with drafts accepted, `n` forks, stop strings and logprobs, every
    output equals an engine that rebuilds the penalties from the token lists at each step."""
    penalized = [
        DecodingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, logprobs=2),
        DecodingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.6),
        DecodingParams(
            max_tokens=24, temperature=0.9, seed=5, n=2, presence_penalty=0.5,
            repetition_penalty=1.1, stop=("la la",),
        ),
    ]  # fmt: skip
    results = []
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr("server.engine.sampling_step.penalty_rows", lambda r, p, t: None)
        engine = make_engine(llama_dir, speculative_tokens=8)
        got = [
            submit(engine, f"{i}-{j}", engine.tokenizer(text * 2).input_ids, params)
            for i, text in enumerate(LOOPING)
            for j, params in enumerate(penalized)
        ]
        run_to_completion(engine)
        results.append([g.choices() for g in got])
        assert engine.stats.spec_accepted_tokens > 0
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.penalty_table.rows_held == 0  # every row gave its place back
        if keep:
            assert engine.penalty_table.tokens.shape[0] > 0  # and the rows had places
    assert results[0] == results[1]
