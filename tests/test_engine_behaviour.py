"""Continuous batching as users see it: joining, leaving, preemption, aborts, stop conditions."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoding import DecodingParams
from decoding.row_tensors import KeptRowTensors, RowTensors
from tests.conftest import make_engine
from tests.engine_driver import generate, run_to_completion, submit

GREEDY = DecodingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_a_short_request_sent_while_a_long_one_decodes_finishes_first(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("Hello world").input_ids
    finished: list[str] = []
    long = submit(
        engine, "long", prompt, DecodingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )
    for _ in range(5):
        engine.step()
    short = submit(
        engine, "short", prompt, DecodingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )
    while engine.step():
        for name, got in (("long", long), ("short", short)):
            if got.finished and name not in finished:
                finished.append(name)
    assert finished == ["short", "long"]
    assert engine.stats.max_seqs_in_step == 2  # both ran in the same forward passes
    assert len(short.token_ids) == 3 and len(long.token_ids) == 40


def test_preemption_under_a_tiny_pool_gives_the_same_tokens_as_a_large_pool(
    llama_dir: Path,
) -> None:
    big = make_engine(llama_dir, num_blocks=512)
    tok = big.tokenizer
    prompts = [
        tok(p).input_ids
        for p in ("The quick brown fox", "Hello world! How are you", "To be or not")
    ]
    expected = [r.token_ids for r in generate(big, prompts, GREEDY)]
    small = make_engine(llama_dir, num_blocks=18, block_size=4)  # 72 slots for ~100 tokens of need
    got = generate(small, prompts, GREEDY)
    assert [r.token_ids for r in got] == expected
    assert small.stats.preemptions > 0
    assert small.pool.num_free == small.pool.num_blocks


def test_abort_frees_the_blocks_and_ends_the_stream(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = engine.tokenizer("Once upon a time there was").input_ids
    victim = submit(
        engine, "victim", prompt, DecodingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    other = submit(
        engine, "other", prompt, DecodingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    engine.abort("victim")
    engine.step()
    assert victim.finish_reason == "abort"
    run_to_completion(engine)
    assert other.finish_reason == "length" and len(other.token_ids) == 10
    assert engine.pool.num_free == engine.pool.num_blocks


def test_seeded_sampling_is_identical_alone_and_inside_a_busy_batch(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    seeded = DecodingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    prompt = tok("The early bird").input_ids
    alone = generate(engine, [prompt], seeded)[0].token_ids
    noise = DecodingParams(max_tokens=16, temperature=1.3, ignore_eos=True)
    others = [
        submit(engine, f"n{i}", tok(f"Noise {i} and more").input_ids, noise) for i in range(5)
    ]
    again = submit(engine, "seeded", prompt, seeded)
    run_to_completion(engine)
    assert again.token_ids == alone
    assert all(o.finished for o in others)
    different_seed = generate(
        engine, [prompt], DecodingParams(max_tokens=16, seed=99, ignore_eos=True)
    )
    assert different_seed[0].token_ids != alone


def test_finish_reasons_length_stop_token_and_stop_string(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    prompt = tok("Hello world! How are you").input_ids
    free = generate(engine, [prompt], GREEDY)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24

    stop_id = free.token_ids[5]
    by_id = generate(
        engine,
        [prompt],
        DecodingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(stop_id,)),
    )[0]
    first = free.token_ids.index(stop_id)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]

    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    by_text = generate(
        engine,
        [prompt],
        DecodingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(needle,)),
    )[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == text[: text.index(needle)]  # the stop string itself is not returned


def test_eos_ends_a_sequence_unless_ignore_eos(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    eos = engine.tokenizer.eos_token_id
    prompt = engine.tokenizer("Hello").input_ids
    # Bias the choice to EOS by declaring the first sampled token an end token.
    first = generate(engine, [prompt], DecodingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    engine.eos_token_ids = frozenset({first, eos})
    stopped = generate(engine, [prompt], DecodingParams(max_tokens=8, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == [first]
    ignored = generate(
        engine, [prompt], DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 8


def test_streamed_text_adds_up_to_the_decoded_tokens(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    got = generate(engine, [tok("Unicode: café, 東京").input_ids], GREEDY)[0]
    assert got.text == tok.decode(got.token_ids, skip_special_tokens=True)


class NeverKept(KeptRowTensors):
    """Builds every step's params-only sampling tensors anew (the engine before it kept them)."""

    def tensors(self, params, eos_ids, vocab_size, device):  # type: ignore[no-untyped-def]
        return RowTensors.of(params, eos_ids, vocab_size, device)


def test_a_steady_batch_keeps_its_sampling_tensors_and_draws_what_a_fresh_build_draws(
    llama_dir: Path,
) -> None:
    """Seeded sampled rows (with penalties, `n`), greedy rows with logprobs and a beam request in
    one batch, requests joining and leaving: the same outputs whether the params-only tensors
    are kept from step to step or built at every step, and most steps reuse them."""
    work = [
        ([5, 9, 13], DecodingParams(max_tokens=12, temperature=0.8, top_k=8, seed=1, n=2)),
        ([7, 7, 8, 9], DecodingParams(max_tokens=20, temperature=0.0, logprobs=2)),
        ([3, 4], DecodingParams(max_tokens=9, top_p=0.8, repetition_penalty=1.2, seed=5)),
        ([6, 5, 4], DecodingParams(max_tokens=14, temperature=0.0, logit_bias={17: 8.0, 9: 3.0})),
        ([11, 12, 13, 14], DecodingParams(max_tokens=8, num_beams=3, n=2)),
    ]
    outputs = []
    for kept in (None, NeverKept()):
        engine = make_engine(llama_dir)
        if kept is not None:
            engine.kept_rows = kept
        got = [submit(engine, str(i), prompt, params) for i, (prompt, params) in enumerate(work)]
        run_to_completion(engine)
        outputs.append([(c.token_ids, c.text) for c in got])
        if kept is None:
            assert engine.kept_rows.hits >= 10
    assert outputs[0] == outputs[1]


def test_penalized_rows_give_their_penalty_table_slots_back(llama_dir: Path) -> None:
    """Beam rows (re-forked every step), `n` rows and an aborted request, all penalized, hold
    slots of the engine's penalty table while they run and none once they are done."""
    engine = make_engine(llama_dir)
    for i in range(2):
        prompt = [5, 6, 7, 8 + i]
        beams = DecodingParams(max_tokens=12, num_beams=3, repetition_penalty=1.3)
        sampled = DecodingParams(max_tokens=12, temperature=0.7, n=2, presence_penalty=0.5, seed=i)
        submit(engine, f"beams-{i}", prompt, beams)
        submit(engine, f"n-{i}", prompt, sampled)
    submit(engine, "victim", [9, 9, 9], DecodingParams(max_tokens=50, frequency_penalty=0.4))
    for _ in range(4):
        engine.step()
    assert engine.penalty_table.rows_held > 0
    engine.abort("victim")
    run_to_completion(engine)
    assert engine.penalty_table.rows_held == 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_processed_logprobs_are_of_the_scores_a_token_was_chosen_from(llama_dir: Path) -> None:
    """The processed mode: log_softmax of the scores after the processors and the truncation
    warpers, temperature undone (what generate()'s Whisper fallback averages); raw: the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 9, 13]
    banned, top_k = 17, 20
    common = dict(
        max_tokens=6, temperature=0.7, top_k=top_k, seed=3, logprobs=0, bad_words_ids=((banned,),)
    )
    engine = make_engine(llama_dir)
    (raw,) = generate(engine, [prompt], DecodingParams(**common))
    (processed,) = generate(engine, [prompt], DecodingParams(**common, logprobs_mode="processed"))
    tokens = processed.token_ids
    assert raw.token_ids == tokens
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    masked = logits.clone()
    masked[:, banned] = -float("inf")
    kth = masked.topk(top_k, dim=-1).values[:, -1:]
    masked[masked < kth] = -float("inf")
    index = torch.tensor(tokens).unsqueeze(1)
    expected = masked.log_softmax(-1).gather(1, index).squeeze(1)
    got = [lp.logprob for o in processed.outputs for lp in o.logprobs or ()]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)
    got_raw = [lp.logprob for o in raw.outputs for lp in o.logprobs or ()]
    model_logprobs = logits.log_softmax(-1).gather(1, index).squeeze(1)
    assert got_raw == pytest.approx(model_logprobs.tolist(), abs=1e-4)
    assert all(p > r for p, r in zip(got, got_raw))  # the same token, less mass beside it
