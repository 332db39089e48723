"""Speculation with a draft model: the same tokens as without it, every KV block back.

A draft model only proposes; the served model verifies every draft as it verifies n-gram drafts,
so greedy rows must be token-identical with and without it, and seeded sampled rows too (their
i-th token draws number i of their random stream either way: the verification rule's own
chi-square test is in test_speculation.py). A draft model with the served model's weights must
have (nearly) every greedy draft accepted: that checks the draft's own KV cache, which lives at
the served pool's block ids (prompts followed, catch-up after a verification, forks, preemption).
A draft model with other weights has its drafts mostly rejected, and changes nothing either.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from decoding import DecodingParams
from decoding.fusion import LMFusion
from server.api.app import create_app
from server.bootstrap import build_serving_context
from server.config import ServerConfig
from server.engine.draft_model import DraftModel
from server.engine.engine import Engine
from server.engine.fusion import Companions
from server.loading import draft_model
from server.model.runner import ModelRunner
from tests.conftest import TEST_DEVICE, make_engine
from tests.engine_driver import Collected, run_to_completion, submit
from tests.test_engine_correctness import hf_greedy
from tests.test_speculation import (
    LOOPING,
    assert_all_blocks_back,
    assert_constrained_rows_unchanged,
    outputs,
    workload,
)
from tests.tiny_models import build_tiny_model

K = 4
BLOCKS = 256


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "other", "llama", seed=1)


def draft_engine(
    main_dir: Path, draft_dir: Path, *, fused: bool = False, k: int = K, **kw: object
) -> Engine:
    """An engine drafting with `draft_dir`'s model, served as extra model "draft" (`fused`: also
    offered to LM fusion)."""
    runner = ModelRunner(
        draft_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=4,
        num_blocks=kw.get("num_blocks", BLOCKS),  # type: ignore[arg-type]
        linear_layout="native",
    )
    draft = DraftModel("draft", runner, k, max_model_len=512)
    companions = Companions({"draft": runner}, runner.vocab_size, draft=draft)
    return make_engine(main_dir, companions=companions, **kw)  # type: ignore[arg-type]


def run(engine: Engine, work: list[tuple[list[int], DecodingParams]]) -> list[Collected]:
    got = [submit(engine, str(i), prompt, params) for i, (prompt, params) in enumerate(work)]
    run_to_completion(engine)
    return got


def drafted(engine: Engine) -> tuple[int, int]:
    stats = engine.stats_snapshot()
    return int(stats["spec_decode_num_draft_tokens"]), int(stats["spec_decode_num_accepted_tokens"])


def test_a_draft_with_the_served_weights_is_accepted_and_greedy_equals_generate(
    llama_dir: Path,
) -> None:
    """Prompts split over steps (the draft follows their chunks), rows verified and caught up
    step after step: a draft model equal to the served one proposes the served model's tokens."""
    texts = [*LOOPING, "a b c d e f g h i j k l m n o p"]
    engine = draft_engine(llama_dir, llama_dir, max_num_batched_tokens=16)
    plain = make_engine(llama_dir, max_num_batched_tokens=16)
    prompts = [engine.tokenizer(text).input_ids for text in texts]
    params = DecodingParams(max_tokens=40, temperature=0.0)
    got = run(engine, [(p, params) for p in prompts])
    assert [g.token_ids for g in got] == [hf_greedy(llama_dir, text, 40) for text in texts]
    run(plain, [(p, params) for p in prompts])
    num_drafted, accepted = drafted(engine)
    assert num_drafted > 100 and accepted >= 0.97 * num_drafted
    assert engine.stats.steps < 0.6 * plain.stats.steps
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("same_weights", [True, False])
def test_a_draft_model_changes_no_output_of_a_mixed_batch(
    llama_dir: Path, other_dir: Path, same_weights: bool
) -> None:
    """Greedy with stop strings and logprobs, seeded sampling with penalties, n and best_of,
    beams (never drafting) and rows fused with the draft model itself (LM fusion: never
    drafting, their companion's cache in the same pool), in one batch."""
    plain = make_engine(llama_dir, max_num_seqs=128, max_num_batched_tokens=256)
    work = workload(plain)
    fusion = LMFusion("draft", 0.5)
    work += [
        (prompt, DecodingParams(max_tokens=20, temperature=0.0, lm_fusion=fusion))
        for prompt, _ in work[::16]
    ]
    draft_dir = llama_dir if same_weights else other_dir
    spec = draft_engine(llama_dir, draft_dir, max_num_seqs=128, max_num_batched_tokens=256)
    reference = draft_engine(llama_dir, draft_dir, max_num_seqs=128, max_num_batched_tokens=256)
    reference.scheduler.drafter = None  # the same extra model for fusion, no drafts
    expected, got = run(reference, work), run(spec, work)
    for want, have, (_, params) in zip(expected, got, work):
        assert have.finished
        assert outputs(have) == outputs(want), params
    num_drafted, accepted = drafted(spec)
    assert num_drafted > 0 and accepted < num_drafted  # sampled rows reject greedy drafts
    if same_weights:
        assert accepted > num_drafted / 2
    assert drafted(reference) == (0, 0)
    for engine in (reference, spec):
        assert_all_blocks_back(engine)
        # every row forgotten there, but those whose release waits for a next step's plan
        assert len(engine.companions.runners["draft"].rows) <= len(engine.scheduler.released)


def test_preemption_and_prefix_cache_with_a_draft_model(llama_dir: Path) -> None:
    """A pool too small for the batch: rows are preempted and recomputed (their draft cache
    with them), cached prefixes carry the draft's keys and values; outputs unchanged and the
    drafts still accepted."""
    work = [(p, d) for p, d in workload(make_engine(llama_dir)) if d.num_beams == 1][:24]
    again = [(p, d) for p, d in work if d.max_tokens >= 30]
    roomy = run(make_engine(llama_dir, max_num_seqs=64), work)
    tight = draft_engine(llama_dir, llama_dir, num_blocks=48, max_num_seqs=64)
    got = run(tight, work + again)
    for want, have in zip(roomy + [roomy[work.index(w)] for w in again], got):
        assert outputs(have) == outputs(want)
    assert tight.stats.preemptions > 0 and tight.stats.prefix_cache_hits > 0
    num_drafted, accepted = drafted(tight)
    assert accepted > num_drafted / 2
    assert_all_blocks_back(tight)


def test_constrained_rows_draft_the_likeliest_tokens_their_grammar_allows(llama_dir: Path) -> None:
    """The draft model's choice is masked by the row's grammar (its unconstrained greedy token
    is rarely legal here), and each draft's grammar state is kept for verification."""
    assert_constrained_rows_unchanged(make_engine(llama_dir), draft_engine(llama_dir, llama_dir))


def test_seeded_samples_are_the_same_tokens_with_a_draft_model(llama_dir: Path) -> None:
    """Over many seeds, at a temperature where most greedy drafts are rejected: the same tokens
    for every seed, so the same distribution."""
    prompt = make_engine(llama_dir).tokenizer(LOOPING[1]).input_ids
    work = [(prompt, DecodingParams(max_tokens=12, temperature=1.2, seed=s)) for s in range(64)]
    plain = run(make_engine(llama_dir, max_num_seqs=64, max_num_batched_tokens=256), work)
    engine = draft_engine(llama_dir, llama_dir, max_num_seqs=64, max_num_batched_tokens=256)
    spec = run(engine, work)
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]
    num_drafted, accepted = drafted(engine)
    assert 0 < accepted < num_drafted
    assert len({tuple(g.token_ids) for g in spec}) > 32  # the seeds drew different samples


def test_a_failing_draft_model_costs_drafts_not_outputs(llama_dir: Path) -> None:
    """Drafts are optional: a draft model whose forward raises leaves every row without drafts
    for that step (its grown blocks given back); nothing fails and the outputs are unchanged."""
    engine = draft_engine(llama_dir, llama_dir)
    runner = engine.companions.runners["draft"]
    calls = 0

    def flaky(plan: object) -> object:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise RuntimeError("draft model down")
        return ModelRunner.execute(runner, plan)  # type: ignore[arg-type]

    runner.execute = flaky  # type: ignore[method-assign]
    prompts = [engine.tokenizer(text).input_ids for text in LOOPING]
    work = [(p, DecodingParams(max_tokens=30, temperature=0.0)) for p in prompts]
    expected = run(make_engine(llama_dir), work)
    got = run(engine, work)
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert all(g.finish_reason == "length" for g in got)
    assert calls > 6 and drafted(engine)[0] > 0
    assert_all_blocks_back(engine)


# ---- served ---------------------------------------------------------------------------------
def test_a_server_drafts_with_its_speculative_model(llama_dir: Path) -> None:
    """`--extra-models draft=... --speculative-model draft`: completions unchanged (greedy equals
    generate()), the drafts counted in the metrics' totals, the draft model also fusable."""
    config = ServerConfig(
        model=str(llama_dir),
        served_model_name="tiny",
        device="cpu",
        num_kv_blocks=128,
        block_size=4,
        engine_process="off",
        extra_models=[f"draft={llama_dir}"],
        speculative_model="draft",
        num_speculative_tokens=3,
    )
    ctx = build_serving_context(config)
    try:
        engine = ctx.engine.engine
        assert isinstance(engine.scheduler.drafter, DraftModel)
        client = TestClient(create_app(ctx=ctx))
        text = LOOPING[0]
        body = {"model": "tiny", "prompt": text, "max_tokens": 30, "temperature": 0}
        got = client.post("/v1/completions", json=body | {"return_token_ids": True})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == hf_greedy(llama_dir, text, 30)
        fused = body | {"lm_fusion": {"model": "draft", "weight": 0.5}}
        assert client.post("/v1/completions", json=fused).status_code == 200
        metrics = client.get("/metrics").text
        name = "beamline:spec_decode_num_accepted_tokens_total"
        accepted = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
        assert accepted is not None and float(accepted.group(1)) > 0
    finally:
        ctx.engine.shutdown()


def test_a_speculative_model_that_cannot_draft_is_refused_at_start_up(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="'draft' is not one of extra_models"):
        ServerConfig(model=str(llama_dir), speculative_model="draft")
    config = ServerConfig(
        model=str(llama_dir), extra_models=[f"draft={llama_dir}"], speculative_model="draft"
    )
    served = SimpleNamespace(vocab_size=100, encoder_decoder=False, max_position_embeddings=64)
    wider = SimpleNamespace(vocab_size=101, max_position_embeddings=64)
    with pytest.raises(ValueError, match="scores 101 tokens and the served model 100"):
        draft_model(config, served, {"draft": wider}, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        off = config.model_copy(update={"num_speculative_tokens": 0})
        draft_model(off, served, {"draft": served}, 64)  # type: ignore[arg-type]
    seq2seq = SimpleNamespace(vocab_size=100, encoder_decoder=True)
    with pytest.raises(ValueError, match="encoder-decoder"):
        draft_model(config, seq2seq, {"draft": served}, 64)  # type: ignore[arg-type]
    draft = draft_model(config, served, {"draft": served}, 64)  # type: ignore[arg-type]
    assert draft is not None and (draft.name, draft.num_tokens) == ("draft", 8)
