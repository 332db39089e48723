"""The engine against transformers itself: logits of mixed batches and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding import DecodingParams
from server.engine.engine import Engine
from server.engine.request import Sequence
from server.model.runner import ModelRunner
from tests.conftest import TEST_DEVICE, hf_reference, make_engine
from tests.engine_driver import generate, stub_rows

ARCHS = ["llama", "gemma3", "qwen2", "mistral"]
PROMPTS = [
    "Hello world! How are you today? I am fine, thank you.",
    "The quick brown fox",
    "Once upon a time there was a little model that served many clients at once.",
    "A journey of a thousand miles",
    "Beam search keeps the best hypotheses",
    "Numbers: 0 1 2 3",
    "To be or not to be, that is the question.",
    "café",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_of_a_mixed_prefill_and_decode_batch_match_transformers(
    arch: str, tiny_model_dirs: dict[str, Path]
) -> None:
    engine = make_engine(tiny_model_dirs[arch], block_size=4, max_num_batched_tokens=12)
    ref, tok = hf_reference(tiny_model_dirs[arch])
    requests = [stub_rows(tok(p).input_ids) for p in PROMPTS[:3]]
    seqs = [r.rows[0] for r in requests]

    def reference_logits(seq: Sequence) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([seq.token_ids])).logits[0, -1]

    checked, mixed = 0, False
    engine.scheduler.add(requests[0])
    for step in range(12):  # the later prompts join while earlier ones decode, in chunks of <= 12
        if step in (2, 4):
            engine.scheduler.add(requests[step // 2])
        plan = engine.scheduler.schedule()
        released = engine.scheduler.take_released()
        logits = engine.runner.execute(engine.plans.build(plan.items, plan.copies, released)).logits
        sampled = engine.scheduler.update_from_output(plan)
        for row, item in enumerate(sampled):
            torch.testing.assert_close(
                logits[row].cpu(), reference_logits(item.seq), atol=1e-4, rtol=1e-4
            )
            item.seq.token_ids.append(int(logits[row].argmax()))
            checked += 1
        if len(plan.items) > 1 and any(i.num_new > 1 for i in plan.items):
            mixed = True
    assert mixed and checked >= 20
    assert max(len(s.token_ids) for s in seqs) > 24  # past the sliding windows of the tiny models


def hf_greedy(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    ref, tok = hf_reference(model_dir)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_greedy_tokens_follow_hf_generate_in_bfloat16(
    arch: str, tiny_model_dirs: dict[str, Path]
) -> None:
    """bfloat16, CUDA's default, against HF generate() with the same weights in bfloat16 on the
    same device (the GPU kit runs this on CUDA). Two bf16 implementations round differently, so
    exact tokens are not the bar (vLLM's is the same): greedy streams agree token for token until
    they first differ, and there each one's token is among the other's top 5 (a near tie, not a
    bug)."""
    model_dir = tiny_model_dirs[arch]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(TEST_DEVICE)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS]
    runner = ModelRunner(
        model_dir, device=TEST_DEVICE, dtype=torch.bfloat16, block_size=4, num_blocks=256
    )
    engine = Engine(runner, tok, max_num_batched_tokens=16)
    params = DecodingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    for ids, ours in zip(prompts, generate(engine, prompts, params)):
        with torch.no_grad():
            out = ref.eval().generate(
                torch.tensor([ids], device=TEST_DEVICE),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, len(ids) :].tolist()
        their_top = [step[0].topk(5).indices.tolist() for step in out.logits]
        our_top = [[t for t, _ in lp.top] for o in ours.outputs for lp in o.logprobs or []]
        assert len(ours.token_ids) == len(theirs) == len(our_top) == 16
        differs = [i for i, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b]
        if differs:
            i = differs[0]
            mine = ours.token_ids
            assert mine[i] in their_top[i] and theirs[i] in our_top[i], (i, mine, theirs)
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_hf_generate_alone_and_when_8_run_concurrently(
    arch: str, tiny_model_dirs: dict[str, Path]
) -> None:
    model_dir = tiny_model_dirs[arch]
    expected = [hf_greedy(model_dir, p, 20) for p in PROMPTS]
    params = DecodingParams(max_tokens=20, temperature=0)
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    tok = engine.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    alone = [generate(engine, [p], params)[0].token_ids for p in prompts[:3]]
    assert alone == expected[:3]
    together = generate(engine, prompts, params)
    assert [r.token_ids for r in together] == expected
    assert engine.stats.max_seqs_in_step == 8
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        (torch.bfloat16, "none"),
        # the int8 formats are CPU GEMMs: refused on another device (devices.py)
        pytest.param(torch.float32, "int8", marks=pytest.mark.cpu_only),
        pytest.param(torch.float32, "int8-weights", marks=pytest.mark.cpu_only),
        pytest.param(torch.float32, "w8a8", marks=pytest.mark.cpu_only),
    ],
)
def test_fast_weight_formats_run_and_stay_close_to_fp32(
    llama_dir: Path, dtype: torch.dtype, quantization: str
) -> None:
    from server.engine.engine import Engine
    from server.model.runner import ModelRunner

    runner = ModelRunner(
        llama_dir,
        device=TEST_DEVICE,
        dtype=dtype,
        block_size=4,
        num_blocks=128,
        quantization=quantization,
    )
    fast = Engine(runner, make_engine(llama_dir).tokenizer)
    exact = make_engine(llama_dir)
    prompts = [exact.tokenizer(p).input_ids for p in PROMPTS[:4]]
    params = DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in generate(exact, prompts, params)]
    got = [r.token_ids for r in generate(fast, prompts, params)]
    first_tokens_agree = sum(g[0] == w[0] for g, w in zip(got, want))
    assert first_tokens_agree >= 3  # approximate formats: close, not equal
    assert fast.pool.num_free == fast.pool.num_blocks


@pytest.mark.cpu_only
def test_an_int8_head_rescores_as_many_candidates_as_the_step_ranks(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's `ranked` reaches the head on both paths (a packed prompt step, decode steps):
    greedy rows rank their 1 likeliest token, so the head re-scores its fewest candidates; a
    top-p row reads every token, so its steps re-score them all."""
    from server.model.quantization import MIN_RESCORED, RESCORED_CANDIDATES, RescoredInt8Head

    asked: list[int] = []
    rescored = RescoredInt8Head.rescored

    def spy(head: RescoredInt8Head, ranked: int = 0) -> int:
        asked.append(rescored(head, ranked))
        return asked[-1]

    monkeypatch.setattr(RescoredInt8Head, "rescored", spy)
    runner = ModelRunner(
        llama_dir, device=TEST_DEVICE, dtype=torch.float32, block_size=4, num_blocks=128,
        quantization="int8",
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(llama_dir)
    engine = Engine(runner, tok)
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    generate(engine, prompts, DecodingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert asked and set(asked) == {MIN_RESCORED}
    asked.clear()
    top_p = DecodingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=1, ignore_eos=True)
    generate(engine, prompts[:1], top_p)
    assert asked and set(asked) == {RESCORED_CANDIDATES}
