"""Beam search, beam sampling and group beam search on scripted toy models whose log-probs we
control: hand-worked cases, HF v4 rules, invariants, and the engine contract (rows, parents)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from decoding import (
    BeamSearch,
    DecodingParams,
    GroupBeamSearch,
    SamplingTensors,
    make_beam_search,
    process_logits,
    step_beam_searches,
)
from decoding.beam_scorer import BeamGroup, BeamStep, FinishedHypotheses, Hypothesis
from decoding.beam_search import accumulated, adjacent_rows

EOS, A, B, C = 0, 1, 2, 3
EOS_IDS = frozenset({EOS})
Model = Callable[[list[int]], torch.Tensor]


def table_model(table: dict[int | None, list[float]]) -> Model:
    """Next-token log-probs depend on the last token only (None: the prompt)."""
    return lambda history: torch.tensor(table[history[-1] if history else None]).log()


def random_model(vocab: int, seed: int, scale: float = 2.5) -> Model:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn((vocab + 1, vocab), generator=g) * scale
    return lambda history: table[history[-1] if history else vocab]


def drive(
    search: BeamSearch | GroupBeamSearch,
    model: Model,
    params: DecodingParams,
    prompt: list[int] | None = None,
    eos_ids: frozenset[int] = EOS_IDS,
) -> tuple[list[Hypothesis], list[BeamStep]]:
    """What the engine does: run the rows the search asks for, fork as `parents` say."""
    prompt = prompt or []
    rows: list[list[int]] = [[]]
    steps, inputs = [], []
    while not search.done:
        assert search.num_rows == len(rows)
        logits = torch.stack([model(prompt + r) for r in rows])
        vocab = logits.shape[-1]
        t = SamplingTensors.from_rows(
            [params] * len(rows), [prompt] * len(rows), rows, eos_ids, vocab, "cpu"
        )
        step = search.step(process_logits(logits, t))
        steps.append(step)
        inputs.append(rows)
        rows = [rows[p] + [tok] for p, tok in zip(step.parents, step.tokens)]
    hyps = search.finalize()
    for h in hyps:  # every token of a hypothesis is a (row, token) the steps reported
        assert len(h.rows) == len(h.token_ids)
        for i, (row, token) in enumerate(zip(h.rows, h.token_ids)):
            assert inputs[i][row] == h.token_ids[:i]
            assert (row, token) in set(zip(steps[i].parents, steps[i].tokens)) | set(
                steps[i].finished
            )
    return hyps, steps


def as_pairs(hyps: list[Hypothesis]) -> list[tuple[list[int], float]]:
    return [(h.token_ids, round(h.score, 5)) for h in hyps]


# ---- the finished set and its stopping rules (HF BeamHypotheses) --------------------------------
def test_finished_hypotheses_keep_the_best_and_track_the_worst() -> None:
    fh = FinishedHypotheses(2, 1.0, False, 10)
    for tokens, total in (([1, 0], -2.0), ([2, 0], -3.0), ([3, 0], -4.0), ([4, 0], -1.0)):
        fh.add(Hypothesis(tokens, fh.score(total, 2), total, "stop"))
    assert sorted(h.token_ids[0] for h in fh.beams) == [1, 4]
    assert fh.worst_score == -1.0


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty", "best_sum", "length", "done"),
    [
        (True, 1.0, 0.0, 2, True),  # full: stop at once
        (False, 1.0, -2.8, 2, False),  # -1.4 could still beat the worst (-1.5)
        (False, 1.0, -3.2, 2, True),  # -1.6 cannot
        ("never", 1.0, -3.2, 2, False),  # exact bound uses max length 10: -0.32
        ("never", -1.0, -2.5, 2, False),  # lp < 0: bound at the current length: -5 > worst -6
        ("never", -1.0, -3.5, 2, True),  # -7 <= worst -6
    ],
)
def test_is_done_rules(
    early_stopping, length_penalty: float, best_sum: float, length: int, done: bool
) -> None:  # noqa: ANN001
    fh = FinishedHypotheses(2, length_penalty, early_stopping, 10)
    assert not fh.is_done(0.0, length)  # never done with fewer than `size` hypotheses
    fh.add(Hypothesis([1], fh.score(-2.0, 2), -2.0, "stop"))
    fh.add(Hypothesis([2], fh.score(-3.0, 2), -3.0, "stop"))
    assert fh.is_done(best_sum, length) is done


# ---- hand-worked beam search --------------------------------------------------------------------
HAND = table_model(
    {
        None: [0.05, 0.5, 0.3, 0.15],
        A: [0.4, 0.3, 0.2, 0.1],
        B: [0.1, 0.2, 0.3, 0.4],
        C: [0.6, 0.2, 0.1, 0.1],
    }
)


def test_hand_worked_beam_search() -> None:
    """W=2, K=4. Step 1: a .5, b .3, c .15, EOS .05 (EOS rank 3 >= W: ignored) -> beams a, b.
    Step 2: aEOS .2 -> finished (score ln .2 / 2), aa .15, bc .12 -> beams aa, bc.
    Step 3: bcEOS .072 and aaEOS .06 finish; the set keeps ln .2/2 and ln .072/3; the best
    candidate's bound ln .072/3 cannot beat the worst kept: done, running beams are dropped."""
    params = DecodingParams(num_beams=2, n=2, max_tokens=5, length_penalty=1.0)
    hyps, steps = drive(BeamSearch(params, EOS_IDS), HAND, params)
    assert [(s.parents, s.tokens) for s in steps[:2]] == [([0, 0], [A, B]), ([0, 1], [A, C])]
    assert steps[2].done and len(steps) == 3
    assert [h.token_ids for h in hyps] == [[A, EOS], [B, C, EOS]]
    assert [h.score for h in hyps] == pytest.approx(
        [math.log(0.2) / 2, math.log(0.072) / 3], abs=1e-6
    )
    assert [h.sum_logprobs for h in hyps] == pytest.approx(
        [math.log(0.2), math.log(0.072)], abs=1e-6
    )
    assert all(h.finish_reason == "stop" for h in hyps)


def test_eos_candidate_at_rank_w_or_worse_never_finishes() -> None:
    """W=2, early_stopping=True. Step 2: aa .2, aEOS .15 (rank 1: finishes), bEOS .135 (rank 2:
    ignored, else the set would be full and the search would stop here), ab .1.
    Step 3: aaa .08, aaEOS .06 (finishes: set full, done), abEOS .045 (rank 2: ignored)."""
    model = table_model(
        {None: [0.05, 0.5, 0.3, 0.15], A: [0.3, 0.4, 0.2, 0.1], B: [0.45, 0.1, 0.15, 0.3]}
    )
    params = DecodingParams(num_beams=2, n=2, max_tokens=3, early_stopping=True)
    hyps, steps = drive(BeamSearch(params, EOS_IDS), model, params)
    assert (steps[1].parents, steps[1].tokens) == ([0, 0], [A, B])
    assert as_pairs(hyps) == [
        ([A, A, EOS], round(math.log(0.06) / 3, 5)),
        ([A, EOS], round(math.log(0.15) / 2, 5)),
    ]


def test_stopping_bound_uses_the_best_candidate_even_if_it_finishes() -> None:
    """v4 `is_done` takes the best of all K candidates (here an EOS one), not the best running
    beam. Step 1: a .4, EOS .3 -> [EOS] (ln .3), b .2. Step 2: aEOS .2 -> [a EOS] (ln .2 / 2),
    aa .08, ba .07 run on: the bound ln .2 / 2 beats the worst kept (ln .3), so not done (the best
    *running* beam, ln .08 / 2, would have stopped here).
    Step 3: aaEOS ln .04 / 3 replaces [EOS]."""
    model = table_model(
        {None: [0.3, 0.4, 0.2, 0.1], A: [0.5, 0.2, 0.15, 0.15], B: [0.1, 0.35, 0.3, 0.25]}
    )
    params = DecodingParams(num_beams=2, n=2, max_tokens=3)
    hyps, steps = drive(BeamSearch(params, EOS_IDS), model, params)
    assert len(steps) == 3
    assert as_pairs(hyps) == [
        ([A, EOS], round(math.log(0.2) / 2, 5)),
        ([A, A, EOS], round(math.log(0.04) / 3, 5)),
    ]


def test_eos_below_rank_w_is_ignored_and_length_limit_adds_running_beams() -> None:
    params = DecodingParams(num_beams=2, n=2, max_tokens=1)
    hyps, steps = drive(BeamSearch(params, EOS_IDS), HAND, params)
    assert len(steps) == 1 and steps[0].done
    assert [(h.token_ids, h.finish_reason) for h in hyps] == [([A], "length"), ([B], "length")]


def test_early_stopping_true_on_the_last_step_follows_v4() -> None:
    """HF v4 marks the request done once W hypotheses are finished, even on the last step, and
    then does not add the running beams: [a, a] (ln .12 / 4 = -0.53) is not returned.
    (transformers >= 4.50's vectorised beam search would return it: a known HF divergence.)"""
    model = table_model(
        {None: [0.3, 0.4, 0.2, 0.1], A: [0.5, 0.3, 0.1, 0.1], B: [0.1, 0.5, 0.3, 0.1]}
    )
    params = DecodingParams(num_beams=2, n=2, max_tokens=2, length_penalty=2.0, early_stopping=True)
    hyps, _ = drive(BeamSearch(params, EOS_IDS), model, params)
    assert as_pairs(hyps) == [
        ([A, EOS], round(math.log(0.2) / 4, 5)),
        ([EOS], round(math.log(0.3), 5)),
    ]


def test_fewer_finite_candidates_run_fewer_rows() -> None:
    """Bans leave one non-EOS token: HF would carry -1e9 dummy beams, we run one row."""
    params = DecodingParams(num_beams=3, n=3, max_tokens=3, bad_words_ids=((B,), (C,)))
    hyps, steps = drive(BeamSearch(params, EOS_IDS), HAND, params)
    assert steps[0].parents == [0] and steps[0].tokens == [A]
    assert all(math.isfinite(h.score) for h in hyps)


def test_finalize_early_returns_running_beams() -> None:
    params = DecodingParams(num_beams=2, n=2, max_tokens=10)
    search = BeamSearch(params, EOS_IDS)
    t = SamplingTensors.from_rows([params], [[]], [[]], EOS_IDS, 4, "cpu")
    search.step(process_logits(HAND([]).unsqueeze(0), t))
    hyps = search.finalize()  # e.g. the context is full
    assert [(h.token_ids, h.finish_reason) for h in hyps] == [([A], "length"), ([B], "length")]
    assert search.done and search.num_rows == 0
    with pytest.raises(RuntimeError):
        search.step(torch.zeros(1, 4))


def test_wrong_number_of_rows_is_refused() -> None:
    search = BeamSearch(DecodingParams(num_beams=2), EOS_IDS)
    with pytest.raises(ValueError):
        search.step(torch.zeros(2, 4))


# ---- beam sampling ------------------------------------------------------------------------------
def sample_params(seed: int | None = None, **kw) -> DecodingParams:
    return DecodingParams(num_beams=3, n=3, do_sample=True, max_tokens=6, seed=seed, **kw)


def test_beam_sample_is_reproducible_with_a_seed() -> None:
    model = random_model(12, 0, scale=1.0)
    runs = [
        as_pairs(drive(BeamSearch(sample_params(s), EOS_IDS), model, sample_params(s))[0])
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0] != as_pairs(
        drive(
            BeamSearch(DecodingParams(num_beams=3, n=3, max_tokens=6), EOS_IDS),
            model,
            sample_params(7),
        )[0]
    )


def test_beam_sample_equals_beam_search_when_every_candidate_is_drawn() -> None:
    """Each row allows exactly 2 tokens, so K = 2W draws take every finite candidate."""
    vocab = 10
    base = random_model(vocab, 3)

    def two_tokens(history: list[int]) -> torch.Tensor:
        logits = base(history)
        keep = logits.topk(2).indices
        return torch.full_like(logits, -math.inf).index_fill(0, keep, 0.0) + logits

    deterministic = DecodingParams(num_beams=2, n=2, max_tokens=6)
    sampled = DecodingParams(num_beams=2, n=2, max_tokens=6, do_sample=True, seed=1)
    expected = as_pairs(drive(BeamSearch(deterministic, EOS_IDS), two_tokens, deterministic)[0])
    for seed in range(3):
        search = BeamSearch(sampled, EOS_IDS, generator=torch.Generator().manual_seed(seed))
        assert as_pairs(drive(search, two_tokens, sampled)[0]) == expected


# ---- batched stepping ---------------------------------------------------------------------------
def test_step_beam_searches_matches_stepping_each_alone() -> None:
    model = random_model(16, 5)
    all_params = [
        DecodingParams(num_beams=2, n=2, max_tokens=5),
        DecodingParams(num_beams=2, n=1, max_tokens=7, length_penalty=0.0),
        DecodingParams(num_beams=4, n=2, max_tokens=6, early_stopping="never"),
        DecodingParams(num_beams=4, n=2, max_tokens=6, early_stopping=True, stop_token_ids=(3,)),
        sample_params(11),
        DecodingParams(num_beams=4, num_beam_groups=2, diversity_penalty=0.7, n=2, max_tokens=5),
    ]
    alone = [as_pairs(drive(make_beam_search(p, EOS_IDS), model, p)[0]) for p in all_params]
    searches = [make_beam_search(p, EOS_IDS) for p in all_params]
    rows_of: dict[int, list[list[int]]] = {id(s): [[]] for s in searches}  # the engine's rows
    while not all(s.done for s in searches):
        live = [s for s in searches if not s.done]
        scores = []
        for s in live:
            rows = rows_of[id(s)]
            logits = torch.stack([model(r) for r in rows])
            t = SamplingTensors.from_rows(
                [s.params] * len(rows), [[]] * len(rows), rows, EOS_IDS, 16, "cpu"
            )
            scores.append(process_logits(logits, t))
        for s, step in zip(live, step_beam_searches(live, scores)):
            old = rows_of[id(s)]
            rows_of[id(s)] = [old[p] + [tok] for p, tok in zip(step.parents, step.tokens)]
    assert [as_pairs(s.finalize()) for s in searches] == alone


def test_searches_whose_rows_lie_back_to_back_are_accumulated_in_one_add() -> None:
    groups = [BeamGroup(2, frozenset({0}), 1.0, False, 8) for _ in range(3)]
    for index, group in enumerate(groups):
        group.beam_scores = torch.tensor([-0.5 * index, -1.5 - index])
    block = torch.randn(6, 11).log_softmax(dim=-1)
    views = [block[0:2], block[2:4], block[4:6]]
    assert adjacent_rows(views) is not None
    expected = torch.stack([g.accumulate(x) for g, x in zip(groups, views)])
    assert torch.equal(accumulated(groups, views), expected)
    gap = [block[0:2], block[4:6]]  # another request's rows between them
    assert adjacent_rows(gap) is None
    assert torch.equal(
        accumulated(groups[:2], gap), torch.stack([g.accumulate(x) for g, x in zip(groups, gap)])
    )
    apart = [torch.randn(2, 11), torch.randn(2, 11)]
    assert adjacent_rows(apart) is None


# ---- group beam search --------------------------------------------------------------------------
def test_hand_worked_group_beam_search() -> None:
    """2 groups of 1 beam, diversity 1.0, K=2 per group.
    Step 1: group 0 takes a (.5). Group 1's a is lowered by 1: b (ln .3) beats a (ln .5 - 1).
    Step 2: group 0: aEOS (ln .2) finishes at rank 0 and closes group 0 (bound == worst).
    Group 1 (after b; a lowered by 1 as group 0's running beam took a): c ln .12, b ln .09 -> c.
    Length limit: group 1's running [b, c] joins with ln(.12) / 2."""
    params = DecodingParams(
        num_beams=2, num_beam_groups=2, diversity_penalty=1.0, n=2, max_tokens=2
    )
    hyps, steps = drive(GroupBeamSearch(params, EOS_IDS), HAND, params)
    assert (steps[0].parents, steps[0].tokens) == ([0, 0], [A, B])
    assert steps[1].done
    assert [(h.token_ids, h.group, h.finish_reason) for h in hyps] == [
        ([A, EOS], 0, "stop"),
        ([B, C], 1, "length"),
    ]
    assert [h.score for h in hyps] == pytest.approx(
        [math.log(0.2) / 2, math.log(0.12) / 2], abs=1e-6
    )


def test_group_zero_is_plain_beam_search_of_its_size() -> None:
    model = random_model(14, 8)
    for es in (False, True, "never"):
        grouped = DecodingParams(
            num_beams=6,
            num_beam_groups=3,
            diversity_penalty=1.5,
            n=4,
            max_tokens=7,
            early_stopping=es,
        )
        plain = DecodingParams(num_beams=2, n=2, max_tokens=7, early_stopping=es)
        search = GroupBeamSearch(grouped, EOS_IDS)
        drive(search, model, grouped)
        reference = BeamSearch(plain, EOS_IDS)
        drive(reference, model, plain)
        assert as_pairs(search.groups[0].finished.beams) == as_pairs(reference.group.finished.beams)
        assert as_pairs(search.groups[1].finished.beams) != as_pairs(reference.group.finished.beams)


def test_zero_diversity_gives_independent_identical_groups() -> None:
    model = random_model(14, 9)
    grouped = DecodingParams(num_beams=6, num_beam_groups=3, n=6, max_tokens=6)
    search = GroupBeamSearch(grouped, EOS_IDS)
    hyps, steps = drive(search, model, grouped)
    plain = DecodingParams(num_beams=2, n=2, max_tokens=6)
    expected = as_pairs(drive(BeamSearch(plain, EOS_IDS), model, plain)[0])
    for g in search.groups:
        assert as_pairs(sorted(g.finished.beams, key=lambda h: -h.score)) == expected
    assert as_pairs(hyps) == [p for p in expected for _ in range(3)]
    assert steps[1].parents == [0, 0, 2, 2, 4, 4]
    assert steps[1].tokens[:2] == steps[1].tokens[2:4] == steps[1].tokens[4:]


def brute_force_group_beam(
    model: Model, vocab: int, params: DecodingParams
) -> list[list[tuple[int, int, int]]]:
    """Reference for the engine contract of group beam search, by plain enumeration: for every
    step, the (group, parent row, token) of each row of the next step, in row order.

    Each running group scores every (beam, token) as running sum + log_softmax - diversity x
    (times the running beams of earlier groups took the token this step), walks the best 2 x S
    (one EOS id) best first: EOS at rank < S finishes, others continue until S beams. A group that
    stops by its own test (2 finished, `early_stopping` rule) hands back no rows; the next step's
    input is the beams of the groups still running, group 0 first."""
    size = params.num_beams // params.num_beam_groups
    groups = [
        {"beams": [([], 0.0)], "finished": [], "stopped": False}
        for _ in range(params.num_beam_groups)
    ]
    steps: list[list[tuple[int, int, int]]] = []
    for length in range(1, params.max_tokens + 1):
        running = [(g, grp) for g, grp in enumerate(groups) if not grp["stopped"]]
        if not running:
            break
        taken: list[int] = []
        next_rows: list[tuple[int, int, int]] = []
        first_row = 0  # this group's first row in the step's input (the prompt row at step 1)
        for g, grp in running:
            cands = []
            for r, (tokens, total) in enumerate(grp["beams"]):
                logp = model(tokens).double().log_softmax(-1).tolist()
                for v in range(vocab):
                    penalty = params.diversity_penalty * taken.count(v)
                    cands.append((total + logp[v] - penalty, r, v))
            cands.sort(key=lambda c: -c[0])
            chosen = []
            for rank, (total, r, v) in enumerate(cands[: 2 * size]):
                if v == EOS:
                    if rank < size:
                        grp["finished"].append(total / length)
                elif len(chosen) < size:
                    chosen.append((total, r, v))
                if len(chosen) == size:
                    break
            grp["finished"] = sorted(grp["finished"], reverse=True)[:size]
            if len(grp["finished"]) == size:
                best_possible = cands[0][0] / length
                grp["stopped"] = params.early_stopping is True or (
                    grp["finished"][-1] >= best_possible
                )
            taken += [v for _, _, v in chosen]
            if not grp["stopped"]:
                next_rows += [(g, first_row + r, v) for _, r, v in chosen]
            if length > 1:
                first_row += len(grp["beams"])
            grp["beams"] = [(grp["beams"][r][0] + [v], total) for total, r, v in chosen]
        steps.append(next_rows)
    return steps


@pytest.mark.parametrize("seed", [4, 11, 13])
@pytest.mark.parametrize("early_stopping", [False, True])
def test_group_beam_rows_are_grouped_in_order(seed: int, early_stopping: bool) -> None:
    """Every step hands back group 0's S beams, then group 1's, each continuing a row of its own
    group's block of the input; a group that stops drops out and the next groups move up."""
    model = random_model(10, seed)
    params = DecodingParams(
        num_beams=4,
        num_beam_groups=2,
        diversity_penalty=0.8,
        n=2,
        max_tokens=4,
        early_stopping=early_stopping,
    )
    search = GroupBeamSearch(params, EOS_IDS)
    _, steps = drive(search, model, params)  # drive() asserts rows == parents + tokens every step
    expected = brute_force_group_beam(model, 10, params)
    assert len(steps) == len(expected)
    blocks = {0: range(0, 1), 1: range(0, 1)}  # step 1: both groups start from the prompt row
    for step, rows in zip(steps, expected):
        assert step.parents == [p for _, p, _ in rows]
        assert step.tokens == [t for _, _, t in rows]
        groups = [g for g, _, _ in rows]
        assert groups == sorted(groups)  # group-major, group 0 first
        assert all(p in blocks[g] for g, p, _ in rows)  # a beam continues a row of its group
        blocks = {g: range(groups.index(g), groups.index(g) + groups.count(g)) for g in groups}


def test_a_stopped_group_hands_back_no_rows_and_the_next_group_moves_up() -> None:
    """Seed 13 with early stopping: group 1 stops after step 2 and group 0 takes rows 0-1."""
    params = DecodingParams(
        num_beams=4,
        num_beam_groups=2,
        diversity_penalty=0.8,
        n=2,
        max_tokens=4,
        early_stopping=True,
    )
    _, steps = drive(GroupBeamSearch(params, EOS_IDS), random_model(10, 13), params)
    assert [(s.parents, s.tokens) for s in steps] == [
        ([0, 0, 0, 0], [9, 3, 9, 3]),
        ([0, 0], [2, 5]),  # group 1 finished two hypotheses and stopped: its rows are gone
        ([0, 0], [9, 6]),  # group 0 alone: its beams are rows 0 and 1
        ([0, 1], [2, 1]),
    ]
