"""DecodingParams: every invalid value or combination names its field; strategy and width rules."""

from __future__ import annotations

import math

import pytest

from decoding import (
    DecodingParams,
    DecodingParamsError,
    check_vocab,
    ranked_tokens,
    request_width,
)

INVALID = [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0, n=2), "max_tokens"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(typical_p=0.0), "typical_p"),
    (dict(typical_p=1.2), "typical_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(frequency_penalty=math.inf), "frequency_penalty"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: -100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "high"}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(bad_words_ids=((),)), "bad_words_ids"),
    (dict(bad_words_ids=((1, -2),)), "bad_words_ids"),
    (dict(bad_words_ids=(5,)), "bad_words_ids"),
    (dict(n=0), "n"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(best_of=0), "best_of"),
    (dict(best_of=3, temperature=0.0), "best_of"),
    (dict(best_of=3, do_sample=False), "best_of"),
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=2, n=3), "n"),
    (dict(num_beams=4, best_of=3), "best_of"),
    (dict(num_beam_groups=0), "num_beam_groups"),
    (dict(num_beam_groups=2), "num_beam_groups"),
    (dict(num_beams=4, num_beam_groups=3), "num_beam_groups"),
    (dict(num_beams=4, num_beam_groups=2, do_sample=True), "do_sample"),
    (dict(num_beams=4, diversity_penalty=1.0), "diversity_penalty"),
    (dict(num_beams=4, num_beam_groups=2, diversity_penalty=-1.0), "diversity_penalty"),
    (dict(length_penalty=math.nan), "length_penalty"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(early_stopping=None), "early_stopping"),
    (dict(do_sample="yes"), "do_sample"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(stop=("",)), "stop"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
]


@pytest.mark.parametrize(
    ("kwargs", "field"), INVALID, ids=[f"{f}-{i}" for i, (_, f) in enumerate(INVALID)]
)
def test_invalid_values_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(DecodingParamsError) as err:
        DecodingParams(**kwargs)
    assert err.value.field == field
    assert err.value.message


@pytest.mark.parametrize(
    ("kwargs", "strategy", "width"),
    [
        (dict(), "sample", 1),
        (dict(temperature=0.0), "greedy", 1),
        (dict(top_k=1), "greedy", 1),
        (dict(do_sample=False), "greedy", 1),
        (dict(n=3), "sample", 3),
        (dict(n=3, temperature=0.0), "greedy", 3),
        (dict(n=2, best_of=5), "best_of", 5),
        (dict(n=2, best_of=2), "sample", 2),
        (
            dict(num_beams=4),
            "beam",
            4,
        ),  # the default temperature 1.0 does not turn beams into sampling
        (dict(num_beams=4, temperature=0.7), "beam", 4),
        (dict(num_beams=4, do_sample=True, n=2), "beam_sample", 4),
        (dict(num_beams=6, num_beam_groups=3, diversity_penalty=0.5), "group_beam", 6),
        (dict(num_beams=4, num_beam_groups=2), "group_beam", 4),
        (dict(num_beams=4, early_stopping="never", length_penalty=-1.0), "beam", 4),
    ],
)
def test_strategy_and_width(kwargs: dict, strategy: str, width: int) -> None:
    p = DecodingParams(**kwargs)
    assert p.strategy == strategy
    assert p.width == width
    assert p.greedy == (strategy in ("greedy", "beam", "group_beam"))


@pytest.mark.parametrize(
    "kwargs, ranked",
    [
        (dict(temperature=0), 1),
        (dict(temperature=0.7, top_k=1), 1),  # collapses to greedy
        (dict(temperature=0, logprobs=5), 5),  # the top logprobs it returns
        (dict(num_beams=4, temperature=0), 8),  # each request's best 2 x beams candidates
        (dict(num_beams=4, temperature=0, min_tokens=5, no_repeat_ngram_size=2), 8),  # bans
        (dict(temperature=1.0, top_k=40), 40),
        (dict(temperature=1.0, top_k=40, top_p=0.9), 40),  # top-p inside the top 40
        (dict(temperature=1.0), None),
        (dict(temperature=1.0, top_p=0.9), None),
        (dict(num_beams=4, do_sample=True, temperature=1.0), None),  # beam sampling
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5, temperature=0), None),
        (dict(temperature=0, repetition_penalty=1.2), None),  # changes values, so ranks
        (dict(temperature=0, frequency_penalty=0.5), None),
        (dict(temperature=0, logit_bias={5: 10.0}), None),
        (dict(temperature=0, allowed_token_ids=[1, 2]), None),
    ],
)
def test_ranked_tokens(kwargs: dict, ranked: int | None) -> None:
    """How many likeliest tokens a row's choice reads (None: all of them)."""
    assert ranked_tokens(DecodingParams(**kwargs)) == ranked


def test_containers_are_normalised() -> None:
    p = DecodingParams(logit_bias={"12": 3, 7: -1.5}, bad_words_ids=[[1, 2], [3]], stop=["x"])
    assert p.logit_bias == {12: 3.0, 7: -1.5}
    assert p.bad_words_ids == ((1, 2), (3,))
    assert p.stop == ("x",)
    assert p == DecodingParams(
        logit_bias={12: 3.0, 7: -1.5}, bad_words_ids=((1, 2), (3,)), stop=("x",)
    )


def test_finishing_ids() -> None:
    eos = frozenset({2, 9})
    assert DecodingParams(stop_token_ids=(5,)).finishing_ids(eos) == {2, 5, 9}
    assert DecodingParams(stop_token_ids=(5,), ignore_eos=True).finishing_ids(eos) == {5}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(logit_bias={400: 1.0}), "logit_bias"),
        (dict(stop_token_ids=(384,)), "stop_token_ids"),
        (dict(bad_words_ids=((1, 999),)), "bad_words_ids"),
    ],
)
def test_check_vocab(kwargs: dict, field: str) -> None:
    with pytest.raises(DecodingParamsError) as err:
        check_vocab(DecodingParams(**kwargs), vocab_size=384)
    assert err.value.field == field


def test_check_vocab_accepts_the_last_token() -> None:
    check_vocab(
        DecodingParams(logit_bias={383: 1.0}, stop_token_ids=(383,), bad_words_ids=((383,),)), 384
    )


@pytest.mark.parametrize(
    ("kwargs", "width"),
    [
        (dict(), 1),
        (dict(n=3), 3),
        (dict(n=2, best_of=5), 5),
        (dict(num_beams=4, n=2), 4),
        (dict(num_beams=4, num_beam_groups=2), 4),
    ],
)
def test_request_width_is_the_params_width(kwargs: dict, width: int) -> None:
    params = DecodingParams(**kwargs)
    assert params.width == request_width(params.n, params.best_of, params.num_beams) == width
