"""Token-exact parity with Hugging Face `generate()` (transformers 5.x, fp32) on a tiny llama.

A reference loop runs the model with full recompute (no KV cache) and drives `decoding` exactly
as the engine does (rows -> from_rows -> process_logits -> choose / beam step -> fork rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList

from decoding import (
    DecodingParams,
    SamplingTensors,
    choose_tokens,
    make_beam_search,
    process_logits,
)
from decoding.random_streams import RandomStreams, stream_key
from tests.tiny_models import build_tiny_model

EOS = 2
EOS_IDS = frozenset({EOS})
PROMPTS = [
    [330, 320, 299, 78, 265, 379, 81, 268, 376],
    [43, 296, 367, 327, 301, 4, 314, 303, 262, 286],
    [332, 80, 275, 328, 295, 224, 364, 86],
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model's matmuls are too small to split; two threads only contend (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path: Path = build_tiny_model(tmp_path_factory.mktemp("decoding_llama") / "llama", "llama")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def last_logits(model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    return model(input_ids=torch.tensor(rows), use_cache=False).logits[:, -1, :]


def ours_single(model: torch.nn.Module, params: DecodingParams, prompt: list[int]) -> list[int]:
    vocab = model.config.vocab_size
    out: list[int] = []
    while len(out) < params.max_tokens:
        t = SamplingTensors.from_rows([params], [prompt], [out], EOS_IDS, vocab, "cpu")
        token = int(choose_tokens(process_logits(last_logits(model, [prompt + out]), t), t)[0])
        out.append(token)
        if token in params.finishing_ids(EOS_IDS):
            break
    return out


def ours_beams(
    model: torch.nn.Module, params: DecodingParams, prompt: list[int]
) -> list[tuple[list[int], float]]:
    vocab = model.config.vocab_size
    search = make_beam_search(params, EOS_IDS)
    rows: list[list[int]] = [[]]
    while not search.done:
        n = len(rows)
        t = SamplingTensors.from_rows([params] * n, [prompt] * n, rows, EOS_IDS, vocab, "cpu")
        step = search.step(process_logits(last_logits(model, [prompt + r for r in rows]), t))
        rows = [rows[p] + [tok] for p, tok in zip(step.parents, step.tokens)]
    return [(h.token_ids, h.score) for h in search.finalize()]


def hf_kwargs(params: DecodingParams) -> dict:
    kw: dict = dict(max_new_tokens=params.max_tokens)
    if params.repetition_penalty != 1.0:
        kw["repetition_penalty"] = params.repetition_penalty
    if params.no_repeat_ngram_size:
        kw["no_repeat_ngram_size"] = params.no_repeat_ngram_size
    if params.min_tokens:
        kw["min_new_tokens"] = params.min_tokens
    if params.bad_words_ids:
        kw["bad_words_ids"] = [list(w) for w in params.bad_words_ids]
    if params.logit_bias:
        kw["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
    return kw


@torch.no_grad()
def hf_generate(model: torch.nn.Module, prompt: list[int], **kw) -> object:
    ids = torch.tensor([prompt])
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True, **kw
    )


def cut_at_eos(row: list[int]) -> list[int]:
    return row[: row.index(EOS) + 1] if EOS in row else row


# ---- greedy with each processor -----------------------------------------------------------------
GREEDY_CASES = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "repetition_penalty_below_1": dict(repetition_penalty=0.8),
    "no_repeat_ngram_1": dict(no_repeat_ngram_size=1),
    "no_repeat_ngram_2": dict(no_repeat_ngram_size=2),
    "min_tokens": dict(min_tokens=5, logit_bias={EOS: 9.0}),
    "logit_bias": dict(logit_bias={97: -5.0, 45: 3.0, 193: -100.0}),
    "bad_words": dict(bad_words_ids=((97,), (20, 20), (338, 338))),
    "all_together": dict(
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        min_tokens=2,
        logit_bias={EOS: 2.0, 45: 1.0},
        bad_words_ids=((254,), (193, 220)),
    ),
}


@cache
def plain_greedy(model: torch.nn.Module, prompt: tuple[int, ...]) -> list[int]:
    return ours_single(model, DecodingParams(temperature=0.0, max_tokens=12), list(prompt))


@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_with_processors_matches_hf(model: torch.nn.Module, case: str) -> None:
    params = DecodingParams(temperature=0.0, max_tokens=12, **GREEDY_CASES[case])
    changed = False
    for prompt in PROMPTS:
        ours = ours_single(model, params, prompt)
        ref = (
            hf_generate(model, prompt, do_sample=False, **hf_kwargs(params))
            .sequences[0, len(prompt) :]
            .tolist()
        )
        assert ours == cut_at_eos(ref), f"prompt {prompt[:3]}"
        changed |= ours != plain_greedy(model, tuple(prompt))
    assert changed, "the processor never changed the output: the test proves nothing"


# ---- sampling with every warper -----------------------------------------------------------------
SAMPLE_CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.2, top_k=8),
    "top_p": dict(top_p=0.6),
    "min_p": dict(min_p=0.1, temperature=1.5),
    "typical_p": dict(typical_p=0.5),
    "everything": dict(
        temperature=0.9, top_k=30, top_p=0.9, min_p=0.02, typical_p=0.95, repetition_penalty=1.2
    ),
}


def hf_sampling_processors(
    model: torch.nn.Module, params: DecodingParams, prompt_len: int
) -> LogitsProcessorList:
    """HF's own processor + warper list, as generate(do_sample=True) builds it."""
    config = GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k or None,
        top_p=params.top_p,
        min_p=params.min_p or None,
        typical_p=params.typical_p,
        eos_token_id=EOS,
        pad_token_id=0,
        **{k: v for k, v in hf_kwargs(params).items() if k != "max_new_tokens"},
    )
    config._eos_token_tensor = torch.tensor([EOS])
    return model._get_logits_processor(config, input_ids_seq_length=prompt_len)


@pytest.mark.parametrize("case", list(SAMPLE_CASES))
def test_sampling_draws_from_hfs_warped_distribution(model: torch.nn.Module, case: str) -> None:
    """Along our own seeded sampling run, every step's processed scores equal HF's processors +
    warpers on the same logits (so the support and the probabilities are HF's), and the drawn
    token lies in that support. (Token-for-token equality with a seeded HF run is not expected:
    we draw by inverse CDF, HF by torch.multinomial; see decoding/sampling.py.)"""
    params = DecodingParams(max_tokens=10, do_sample=True, **SAMPLE_CASES[case])
    vocab = model.config.vocab_size
    for seed, prompt in enumerate(PROMPTS[:2]):
        hf = hf_sampling_processors(model, params, len(prompt))
        key = stream_key(seed)
        out: list[int] = []
        for _ in range(params.max_tokens):
            logits = last_logits(model, [prompt + out])
            t = SamplingTensors.from_rows([params], [prompt], [out], EOS_IDS, vocab, "cpu")
            ours = process_logits(logits, t)
            expected = hf(torch.tensor([prompt + out]), logits.clone())
            assert torch.equal(torch.isinf(ours), torch.isinf(expected))
            torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])
            token = int(choose_tokens(ours, t, RandomStreams.of([key], [len(out)], "cpu"))[0])
            assert not torch.isinf(expected[0, token])
            out.append(token)
        assert len(set(out)) > 1


# ---- beam search: sequences and scores ----------------------------------------------------------
# (num_beams, length_penalty, early_stopping, n, EOS bias): every width, penalty and stopping
# rule, with an EOS bias so that hypotheses also finish early. Cases where transformers >= 4.50
# departs from v4 (early_stopping=True filling the set on the last step) are covered in
# test_decoding_beams.py instead.
BEAM_CASES = [
    (2, 1.0, False, 1, 0.0),
    (2, -1.0, True, 2, 3.0),
    (2, 0.0, "never", 2, 5.0),
    (4, 1.0, False, 3, 3.0),
    (4, 2.0, "never", 4, 5.0),
    (4, -1.0, False, 2, 5.0),
    (4, 0.0, True, 1, 3.0),
    (8, 1.0, True, 3, 0.0),
    (8, 2.0, False, 8, 3.0),
    (8, -1.0, "never", 4, 5.0),
    (8, 0.0, False, 2, 5.0),
]


@pytest.mark.parametrize(
    ("num_beams", "length_penalty", "early_stopping", "n", "eos_bias"), BEAM_CASES
)
def test_beam_search_matches_hf(
    model: torch.nn.Module,
    num_beams: int,
    length_penalty: float,
    early_stopping: bool | str,
    n: int,
    eos_bias: float,
) -> None:
    params = DecodingParams(
        max_tokens=7,
        num_beams=num_beams,
        n=n,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        logit_bias={EOS: eos_bias} if eos_bias else {},
    )
    for prompt in PROMPTS[:2]:
        check_beams(model, params, prompt)


def check_beams(model: torch.nn.Module, params: DecodingParams, prompt: list[int]) -> None:
    out = hf_generate(
        model,
        prompt,
        do_sample=False,
        num_beams=params.num_beams,
        num_return_sequences=params.n,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        output_scores=True,
        **hf_kwargs(params),
    )
    ref = [cut_at_eos(row) for row in out.sequences[:, len(prompt) :].tolist()]
    ours = ours_beams(model, params, prompt)
    assert [tokens for tokens, _ in ours] == ref
    torch.testing.assert_close(
        torch.tensor([s for _, s in ours]), out.sequences_scores, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "processors",
    [
        dict(repetition_penalty=1.4, logit_bias={EOS: 2.0}),
        dict(no_repeat_ngram_size=2, min_tokens=3, logit_bias={EOS: 6.0}),
        dict(bad_words_ids=((45,), (20, 20)), logit_bias={EOS: 3.0, 340: -2.0}),
    ],
    ids=["repetition", "ngram_min_tokens", "bad_words_bias"],
)
def test_beam_search_with_processors_matches_hf(model: torch.nn.Module, processors: dict) -> None:
    """Beam rows are processed as log-probs, as HF does (it matters for the repetition penalty)."""
    params = DecodingParams(max_tokens=6, num_beams=4, n=2, **processors)
    for prompt in PROMPTS:
        check_beams(model, params, prompt)
