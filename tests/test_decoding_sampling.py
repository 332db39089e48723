"""Token choice: seeded rows are batch-independent, draws follow the warped distribution, logprobs
read the raw model distribution, sample-and-rank picks the most likely samples."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding import (
    DecodingParams,
    SamplingTensors,
    choose_tokens,
    process_logits,
    rank_samples,
    sample,
    token_logprobs,
)
from decoding.random_streams import RandomStreams, random_key, sibling_key, stream_key
from decoding.row_tensors import KeptRowTensors, RowRecord, RowTensors

V = 50
EOS = frozenset({2})
# chi-square critical values at alpha = 0.001 by degrees of freedom
CHI2_CRIT_001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
}


def toy_logits(history: list[int]) -> torch.Tensor:
    """A deterministic 'model': logits depend on the last two tokens."""
    g = torch.Generator().manual_seed(
        1000 + 31 * (history[-1] if history else 0) + (history[-2] if len(history) > 1 else 0)
    )
    return torch.randn(V, generator=g) * 2.0


def run_rows(
    params: list[DecodingParams], prompts: list[list[int]], seeds: list[int | None], steps: int
) -> list[list[int]]:
    """Drive several requests one step at a time in one batch, as the engine does: each sampling
    row draws number len(output) of its stream (its seed's, else a random key)."""
    keys = [stream_key(s) if s is not None else random_key() for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        logits = torch.stack([toy_logits(p + o) for p, o in zip(prompts, outputs)])
        t = SamplingTensors.from_rows(params, prompts, outputs, EOS, V, "cpu")
        rows = t.sample_row_list
        streams = RandomStreams.of([keys[r] for r in rows], [len(outputs[r]) for r in rows], "cpu")
        for row, token in enumerate(choose_tokens(process_logits(logits, t), t, streams).tolist()):
            outputs[row].append(token)
    return outputs


SEEDED = DecodingParams(
    temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.2, max_tokens=30
)


def test_seeded_row_gives_the_same_tokens_alone_and_in_a_busy_batch() -> None:
    alone = run_rows([SEEDED], [[5, 6]], [1234], steps=25)[0]
    busy = run_rows(
        [
            DecodingParams(temperature=1.3),
            DecodingParams(temperature=0.0, repetition_penalty=1.5),
            SEEDED,
            DecodingParams(num_beams=2),  # a beam row: draws nothing
            DecodingParams(temperature=0.7, top_p=0.5, seed=99),
            DecodingParams(min_p=0.2, presence_penalty=1.0),
        ],
        [[1], [2, 3], [5, 6], [7], [8], [9, 9]],
        [None, None, 1234, 4321, 99, None],
        steps=25,
    )
    assert busy[2] == alone
    assert run_rows([SEEDED], [[5, 6]], [1235], steps=25)[0] != alone  # the seed matters


def test_sibling_rows_draw_from_streams_of_their_own() -> None:
    """n = 3 rows of one seeded request: reproducible in any row order, and the three samples
    differ."""
    params = [DecodingParams(n=3, temperature=1.0, max_tokens=10)] * 3
    keys = [sibling_key(stream_key(7), k) for k in range(3)]
    assert len(set(keys)) == 3
    logits = torch.stack([toy_logits([1])] * 3)
    t = SamplingTensors.from_rows(params, [[1]] * 3, [[]] * 3, EOS, V, "cpu")

    def draws(order: list[int]) -> list[list[int]]:
        picked = []
        for step in range(8):
            streams = RandomStreams.of([keys[k] for k in order], [step] * 3, "cpu")
            tokens = choose_tokens(process_logits(logits, t), t, streams).tolist()
            picked.append([tokens[order.index(k)] for k in range(3)])  # back in sibling order
        return picked

    assert draws([0, 1, 2]) == draws([2, 0, 1])
    assert len({tuple(d) for d in zip(*draws([0, 1, 2]))}) > 1


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    total = counts.sum()
    expected = probs[support] * total
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        DecodingParams(temperature=1.0),
        DecodingParams(temperature=0.6, top_k=6),
        DecodingParams(temperature=1.4, top_p=0.7),
        DecodingParams(min_p=0.15, repetition_penalty=1.3),
        DecodingParams(typical_p=0.6, logit_bias={0: 2.0}),
    ],
    ids=["plain", "top_k", "top_p", "min_p", "typical"],
)
@pytest.mark.parametrize("one_stream", [False, True], ids=["global-rng", "one-stream"])
def test_draw_frequencies_follow_the_warped_distribution(
    params: DecodingParams, one_stream: bool
) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(10, generator=g) * 1.5
    rows = 6000
    logits = torch.full((rows, 10), 0.0)
    logits[:] = base
    prompt = [[1, 3]] * rows
    t = SamplingTensors.from_rows([params] * rows, prompt, [[]] * rows, EOS, 10, "cpu")
    scores = process_logits(logits, t)
    probs = scores[0].softmax(-1)
    # the global RNG, or one row's stream read at 6000 counters (what one row draws over time)
    streams = RandomStreams.of([stream_key(11)] * rows, range(rows), "cpu") if one_stream else None
    tokens = choose_tokens(scores, t, streams)
    counts = torch.bincount(tokens, minlength=10).float()
    assert counts[probs == 0].sum() == 0, "drew a token outside the kept support"
    stat, df = chi_square(counts, probs)
    assert df >= 1
    assert stat < CHI2_CRIT_001[df], f"chi2 {stat:.1f} with {df} dof"


def test_greedy_rows_take_the_argmax_of_processed_scores() -> None:
    logits = torch.stack([toy_logits([4]), toy_logits([5])])
    favourite = int(logits[0].argmax())
    params = [
        DecodingParams(temperature=0.0, logit_bias={favourite: -100.0}),
        DecodingParams(top_k=1),
    ]
    t = SamplingTensors.from_rows(params, [[4], [5]], [[], []], EOS, V, "cpu")
    tokens = choose_tokens(process_logits(logits, t), t).tolist()
    assert tokens[0] != favourite and tokens[0] == int(
        logits[0].clone().index_fill_(0, torch.tensor([favourite]), -1e9).argmax()
    )
    assert tokens[1] == int(logits[1].argmax())


def test_logprobs_read_the_raw_distribution() -> None:
    logits = torch.stack([toy_logits([1]), toy_logits([2]), toy_logits([3])])
    params = [DecodingParams(temperature=0.3, repetition_penalty=2.0, logprobs=3)] * 3
    t = SamplingTensors.from_rows(params, [[1], [2], [3]], [[]] * 3, EOS, V, "cpu")
    tokens = choose_tokens(
        process_logits(logits, t), t, RandomStreams.of([1, 2, 3], [0] * 3, "cpu")
    )
    lp = token_logprobs(logits, tokens, num_top=3)
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(lp.chosen, raw.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(lp.top_logprobs, raw.topk(3).values)
    assert lp.top_ids.tolist() == raw.topk(3).indices.tolist()
    chosen, top = lp.row(1, k=2)
    assert (
        chosen == pytest.approx(float(raw[1, tokens[1]]))
        and len(top) == 2
        and top[0][0] == int(raw[1].argmax())
    )
    # beam children: several (row, token) pairs may share a parent row
    pairs = token_logprobs(logits, [5, 6, 7], rows=[0, 0, 2])
    torch.testing.assert_close(pairs.chosen, raw[[0, 0, 2], [5, 6, 7]])
    assert t.logprob_rows == [0, 1, 2]


def test_rank_samples() -> None:
    assert rank_samples([-5.0, -1.0, -3.0, -1.0], 2) == [1, 3]
    assert rank_samples([-4.0, -3.0], 1) == [1]  # the sum: no length normalisation


def test_best_of_rows_draw_and_ask_for_logprobs() -> None:
    params = [DecodingParams(n=1, best_of=3)] * 3
    t = SamplingTensors.from_rows(params, [[1]] * 3, [[]] * 3, EOS, V, "cpu")
    assert t.sample_row_list == [0, 1, 2] and t.logprob_rows == [0, 1, 2]
    cumulative = [0.0, 0.0, 0.0]
    outputs: list[list[int]] = [[], [], []]
    keys = [sibling_key(stream_key(5), k) for k in range(3)]
    for step in range(6):
        logits = torch.stack([toy_logits([1] + o) for o in outputs])
        t = SamplingTensors.from_rows(params, [[1]] * 3, outputs, EOS, V, "cpu")
        tokens = choose_tokens(
            process_logits(logits, t), t, RandomStreams.of(keys, [step] * 3, "cpu")
        )
        for i, (tok, lp) in enumerate(
            zip(tokens.tolist(), token_logprobs(logits, tokens).chosen.tolist())
        ):
            outputs[i].append(tok)
            cumulative[i] += lp
    best = rank_samples(cumulative, 1)[0]
    assert cumulative[best] == max(cumulative)
    assert math.isfinite(cumulative[best])


MIXED_WARPERS: list[dict[str, float | int]] = [
    {"top_k": 40},
    {"top_k": 40, "top_p": 0.8},
    {"top_k": 10, "top_p": 0.9, "min_p": 0.05},
    {"top_p": 0.7},
    {"top_k": 25, "typical_p": 0.9},
    {"min_p": 0.1, "top_k": 30},
    {},
]
ALIGNED_WARPERS: list[dict[str, float | int]] = [  # every top-k row has top-p: one topk serves both
    {"top_k": 5, "top_p": 0.9},
    {"top_k": 40, "top_p": 0.7},
    {"top_k": 17, "top_p": 0.95, "min_p": 0.02},
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("choices", [MIXED_WARPERS, ALIGNED_WARPERS], ids=["mixed", "aligned"])
def test_the_one_read_path_equals_the_exact_one_for_mixed_warper_rows(
    seed: int, choices: list[dict[str, float | int]]
) -> None:
    """`sample` (top-k's largest entries reused by the first sorting warper, nothing read back
    but the tokens) gives the exact path's scores and tokens whichever rows use which warper."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows = 2000, 12
    logits = torch.randn(rows, vocab, generator=gen) * 3
    picks = torch.randint(len(choices), (rows,), generator=gen).tolist()
    params = [
        DecodingParams(temperature=0.5 + 0.1 * r, seed=r, **choices[c])  # type: ignore[arg-type]
        for r, c in enumerate(picks)
    ]
    t = SamplingTensors.from_rows(params, [[1]] * rows, [[]] * rows, EOS, vocab, "cpu")

    streams = RandomStreams.of([stream_key(r) for r in range(rows)], [0] * rows, "cpu")
    want = process_logits(logits, t)
    scores, tokens = sample(logits, t, streams)
    torch.testing.assert_close(scores, want)
    assert tokens == choose_tokens(want, t, streams).tolist()


# ---- the params-only tensors kept from step to step -------------------------------------------
def _mixed_params() -> list[DecodingParams]:
    sampled = DecodingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3)
    return [
        DecodingParams(temperature=0.0),
        sampled,
        sampled,  # a request's second row: the same object
        DecodingParams(temperature=1.2, min_p=0.1, logprobs=2),
        DecodingParams(num_beams=2),
        DecodingParams(num_beams=2, do_sample=True, temperature=0.9),
    ]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
        )
    return a == b


def test_kept_row_tensors_are_reused_only_for_the_same_params_in_the_same_order() -> None:
    params = _mixed_params()
    prompts, outputs = [[1, 2, 3]] * len(params), [[4, 5]] * len(params)
    kept = KeptRowTensors()

    def build(rows: list[DecodingParams]) -> SamplingTensors:
        return SamplingTensors.from_rows(
            rows, prompts[: len(rows)], outputs[: len(rows)], frozenset({0}), 50, "cpu", kept=kept
        )

    first = build(params)
    again = build(list(params))  # another list, the same objects: reused
    assert kept.hits == 1
    fresh = SamplingTensors.from_rows(params, prompts, outputs, frozenset({0}), 50, "cpu")
    for tensors in (first, again):
        assert _equal(tensors, fresh)
    assert again.warpers is not first.warpers  # each step its own (its `unsure` flag)
    equal_but_new = [
        *params[:3],
        DecodingParams(temperature=1.2, min_p=0.1, logprobs=2),
        *params[4:],
    ]
    changed = build(equal_but_new)  # equal, but another request's: rebuilt, not trusted
    assert kept.hits == 1 and _equal(changed, fresh)
    reordered = build([params[1], params[0], *params[2:]])
    assert kept.hits == 1
    assert _equal(
        reordered,
        SamplingTensors.from_rows(
            [params[1], params[0], *params[2:]], prompts, outputs, frozenset({0}), 50, "cpu"
        ),
    )
    shorter = build(params[:4])  # a request left
    assert kept.hits == 1 and shorter.num_rows == 4


def test_kept_row_tensors_draw_the_tokens_a_fresh_build_draws() -> None:
    """Step after step with the same rows, seeded: the same tokens as tensors built anew."""
    params = [p for p in _mixed_params() if not p.is_beam]
    kept = KeptRowTensors()
    tokens: dict[int, list[list[int]]] = {1: [], 0: []}
    torch.manual_seed(0)
    logits_steps = [torch.randn(len(params), 50) for _ in range(4)]
    for use_kept in (1, 0):
        for step, logits in enumerate(logits_steps):
            t = SamplingTensors.from_rows(
                params,
                [[1, 2, 3]] * len(params),
                [[4, 5]] * len(params),
                frozenset({0}),
                50,
                "cpu",
                kept=kept if use_kept else None,
            )
            rows = t.sample_row_list
            streams = RandomStreams.of([7 + r for r in rows], [step] * len(rows), "cpu")
            tokens[use_kept].append(sample(logits, t, streams)[1])
    assert kept.hits == 3
    assert tokens[1] == tokens[0]


KINDS_OF_REQUEST = (
    lambda: DecodingParams(temperature=0.0),
    lambda: DecodingParams(temperature=0.0, logprobs=1),
    lambda: DecodingParams(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3),
    lambda: DecodingParams(temperature=1.2, min_p=0.1, logprobs=2),
    lambda: DecodingParams(temperature=1.0, typical_p=0.8, seed=3),
    lambda: DecodingParams(temperature=0.9, top_k=70),  # k past the vocabulary: top-k is off
    lambda: DecodingParams(temperature=0.8, n=2, best_of=3),
    lambda: DecodingParams(num_beams=2),
    lambda: DecodingParams(
        num_beams=2, do_sample=True, temperature=0.9, top_k=3, stop_token_ids=[7]
    ),
    lambda: DecodingParams(num_beams=4, num_beam_groups=2, diversity_penalty=0.5),
    lambda: DecodingParams(temperature=0.0, logit_bias={3: 5.0, 11: -100.0}),
    lambda: DecodingParams(temperature=0.6, top_p=0.8, logit_bias={40: 2.5}, n=2),
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "leave", "fork", "reorder", "same"]),
            st.integers(0, len(KINDS_OF_REQUEST) - 1),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_kept_row_tensors_through_joins_leaves_forks_and_reorders_equal_a_fresh_build(
    changes: list[tuple[str, int, int]],
) -> None:
    """Step by step, requests joining (with 1-3 rows), leaving, forking a row (`n`, beams),
    the rows reordered or unchanged: the kept tensors always equal ones built from the rows'
    params anew, and a request's record is worked out once while it runs."""
    kept = KeptRowTensors()
    rows: list[DecodingParams] = []
    built: list[DecodingParams] = []
    of = RowRecord.of

    def counting(p: DecodingParams, eos: frozenset[int], v: int) -> RowRecord:
        built.append(p)
        return of(p, eos, v)

    RowRecord.of = counting  # type: ignore[method-assign]
    try:
        for change, kind, width in changes:
            requests = list(dict.fromkeys(map(id, rows)))
            if change == "join" or not rows:
                rows += [KINDS_OF_REQUEST[kind]()] * width
            elif change == "leave":
                gone = requests[kind % len(requests)]
                rows = [p for p in rows if id(p) != gone]
            elif change == "fork":
                r = kind % len(rows)
                rows.insert(r, rows[r])
            elif change == "reorder":
                rows = rows[width:] + rows[:width]
            got = kept.tensors(rows, EOS, V, "cpu")
            fresh = RowTensors.of_records([of(p, EOS, V) for p in rows], V, "cpu")
            assert _equal(got, fresh), change
        assert len(built) == len(set(map(id, built)))  # never twice for one request
    finally:
        RowRecord.of = of  # type: ignore[method-assign]
