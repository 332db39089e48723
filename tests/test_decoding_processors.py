"""Processors and warpers against HF's own classes, row by row inside one mixed batch.

Each batch mixes rows with different parameters (and rows without any); every row must equal
HF's processor applied to that row alone, which checks both the semantics and the per-row
vectorisation. Logits are random with deliberate ties.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from decoding import DecodingParams, SamplingTensors, process_logits
from decoding.penalty_table import PenaltyRow, PenaltyTable
from decoding.processors import bad_word_bans, ngram_bans

V = 40
EOS = frozenset({2})


def random_logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((rows, V), generator=g) * 2.0
    logits[:, 10:13] = logits[:, 10:11]  # ties, for top-k's "keep ties" rule
    return logits


def histories(rows: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 12, (6,), generator=g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, 12, (r % 4 + 1,), generator=g).tolist() for r in range(rows)]
    return prompts, outputs


def hf_row(
    processors: list, prompt: list[int], output: list[int], row: torch.Tensor
) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    return LogitsProcessorList(processors)(ids, row.unsqueeze(0).clone())[0]


def run(params: list[DecodingParams], logits: torch.Tensor, prompts, outputs) -> torch.Tensor:
    t = SamplingTensors.from_rows(params, prompts, outputs, EOS, V, "cpu")
    return process_logits(logits, t)


def assert_rows_match(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-6, atol=1e-6)


def greedy(**kw) -> DecodingParams:
    return DecodingParams(temperature=0.0, max_tokens=20, **kw)


PROCESSOR_CASES = [
    (greedy(repetition_penalty=1.5), lambda p: [RepetitionPenaltyLogitsProcessor(1.5)]),
    (greedy(repetition_penalty=0.7), lambda p: [RepetitionPenaltyLogitsProcessor(0.7)]),
    (greedy(no_repeat_ngram_size=1), lambda p: [NoRepeatNGramLogitsProcessor(1)]),
    (greedy(no_repeat_ngram_size=2), lambda p: [NoRepeatNGramLogitsProcessor(2)]),
    (greedy(no_repeat_ngram_size=3), lambda p: [NoRepeatNGramLogitsProcessor(3)]),
    (greedy(min_tokens=3), "min_tokens"),
    (
        greedy(logit_bias={3: 2.5, 7: -4.0, 2: 1.0}),
        lambda p: [SequenceBiasLogitsProcessor({(3,): 2.5, (7,): -4.0, (2,): 1.0})],
    ),
    (
        greedy(bad_words_ids=((5,), (2,), (2, 6), (1, 2, 8))),
        lambda p: [NoBadWordsLogitsProcessor([[5], [2], [2, 6], [1, 2, 8]], eos_token_id=2)],
    ),
    (
        greedy(
            logit_bias={3: 1.5, 5: -2.0},
            repetition_penalty=1.3,
            no_repeat_ngram_size=2,
            bad_words_ids=((9,),),
        ),
        lambda p: [
            SequenceBiasLogitsProcessor({(3,): 1.5, (5,): -2.0}),
            RepetitionPenaltyLogitsProcessor(1.3),
            NoRepeatNGramLogitsProcessor(2),
            NoBadWordsLogitsProcessor([[9]], eos_token_id=2),
        ],
    ),
    (greedy(), lambda p: []),
]


def test_processors_match_hf_per_row_in_one_batch() -> None:
    rows = len(PROCESSOR_CASES)
    logits = random_logits(rows, 0)
    prompts, outputs = histories(rows, 1)
    prompts[7] = [1, 2, 8, 4]  # makes the multi-token bad words (2, 6) and (1, 2, 8) live
    outputs[7] = [1, 2]
    ours = run([c[0] for c in PROCESSOR_CASES], logits, prompts, outputs)
    for r, (params, make) in enumerate(PROCESSOR_CASES):
        if make == "min_tokens":
            processors = [MinNewTokensLengthLogitsProcessor(len(prompts[r]), params.min_tokens, 2)]
        else:
            processors = make(params)
        expected = hf_row(processors, prompts[r], outputs[r], logits[r])
        assert_rows_match(ours[r], expected)
    assert torch.isinf(ours[7, 6]) and torch.isinf(ours[7, 8]), (
        "multi-token bad words did not apply"
    )
    assert not torch.isinf(ours[7, 2]), "a bad word equal to EOS is ignored, as in HF"


def test_processors_apply_to_log_probs_on_beam_rows() -> None:
    """HF beam search processes log_softmax(logits): the sign-based repetition penalty differs."""
    logits = random_logits(2, 3) + 3.0  # mostly positive logits, negative log-probs
    prompts, outputs = histories(2, 4)
    params = [greedy(repetition_penalty=1.4), DecodingParams(num_beams=2, repetition_penalty=1.4)]
    ours = run(params, logits, prompts, outputs)
    assert_rows_match(
        ours[0], hf_row([RepetitionPenaltyLogitsProcessor(1.4)], prompts[0], outputs[0], logits[0])
    )
    beam_expected = hf_row(
        [RepetitionPenaltyLogitsProcessor(1.4)], prompts[1], outputs[1], logits[1].log_softmax(-1)
    )
    assert_rows_match(ours[1], beam_expected)


def test_min_tokens_blocks_eos_and_stop_ids_only_while_short() -> None:
    params = [
        greedy(min_tokens=3, stop_token_ids=(7,)),
        greedy(min_tokens=2),
        greedy(min_tokens=3, ignore_eos=True),
    ]
    logits = random_logits(3, 5)
    ours = run(params, logits, [[1], [1], [1]], [[4, 5], [4, 5], [4]])
    assert torch.isinf(ours[0, 2]) and torch.isinf(
        ours[0, 7]
    )  # 2 < 3 tokens: EOS and stop id blocked
    assert not torch.isinf(ours[1]).any()  # already 2 tokens
    assert (
        not torch.isinf(ours[2, 2]) and torch.isinf(ours[2]).sum() == 0
    )  # EOS ignored: nothing to block


def test_forced_first_and_last_tokens_match_hf_at_their_steps_only() -> None:
    """generate()'s forced BOS (at the first new token) and forced EOS (at the last one
    max_tokens allows: HF's cur_len == max_length - 1) override every other processor, on
    logits and on a beam row's log-probs; other steps are left alone."""
    max_tokens, prompt = 5, [7]  # HF: the decoder's start alone; max_length = 1 + max_tokens
    forced = dict(forced_bos_token_id=9, forced_eos_token_ids=(2, 4), max_tokens=max_tokens)
    params = [
        DecodingParams(temperature=0.0, no_repeat_ngram_size=1, **forced),
        DecodingParams(num_beams=2, **forced),
    ]
    hf = [
        ForcedBOSTokenLogitsProcessor(9),
        ForcedEOSTokenLogitsProcessor(1 + max_tokens, [2, 4]),
    ]
    for made in range(max_tokens):
        output = list(range(20, 20 + made))
        logits = random_logits(2, made)
        ours = run(params, logits, [prompt, prompt], [output, output])
        greedy_ref = hf_row([NoRepeatNGramLogitsProcessor(1), *hf], prompt, output, logits[0])
        assert_rows_match(ours[0], greedy_ref)
        assert_rows_match(ours[1], hf_row(hf, prompt, output, logits[1].log_softmax(-1)))
        forced_now = made == 0 or made == max_tokens - 1
        assert (torch.isinf(ours).sum(dim=1) >= V - 2).all() == forced_now


def test_presence_and_frequency_penalties_follow_openai() -> None:
    """mu[j] - c[j] * frequency - (c[j] > 0) * presence, counting generated tokens only."""
    params = [
        greedy(presence_penalty=0.5, frequency_penalty=0.25),
        greedy(frequency_penalty=-1.0),
        greedy(),
    ]
    logits = random_logits(3, 6)
    prompts = [[3, 3, 3]] * 3  # the prompt does not count
    outputs = [[5, 5, 6], [5], [5, 6]]
    ours = run(params, logits, prompts, outputs)
    expected = logits.clone()
    expected[0, 5] -= 2 * 0.25 + 0.5
    expected[0, 6] -= 0.25 + 0.5
    expected[1, 5] += 1.0
    assert_rows_match(ours, expected)


def test_ngram_and_bad_word_helpers() -> None:
    history = torch.tensor([1, 2, 3, 1, 2, 4, 1, 2])
    assert sorted(ngram_bans(history, 3).tolist()) == [3, 4]  # "1 2" was followed by 3 and 4
    assert ngram_bans(history, 9).tolist() == []
    assert sorted(bad_word_bans([1, 2], [3], [(2, 3, 9), (3, 7), (5,), (2,)], EOS)) == [5, 7, 9]


def sampler(**kw) -> DecodingParams:
    return DecodingParams(max_tokens=20, **kw)


WARPER_CASES = [
    (sampler(temperature=0.5), [TemperatureLogitsWarper(0.5)]),
    (sampler(top_k=5), [TopKLogitsWarper(5)]),
    (sampler(top_k=11), [TopKLogitsWarper(11)]),  # the 11th value is tied with 12th and 13th
    (sampler(top_p=0.6), [TopPLogitsWarper(0.6)]),
    (sampler(top_p=0.05), [TopPLogitsWarper(0.05)]),
    (sampler(min_p=0.1), [MinPLogitsWarper(0.1)]),
    (sampler(min_p=0.9), [MinPLogitsWarper(0.9)]),
    (sampler(typical_p=0.5), [TypicalLogitsWarper(0.5)]),
    (
        sampler(temperature=1.7, top_k=20, top_p=0.8, min_p=0.05, typical_p=0.9),
        [
            TemperatureLogitsWarper(1.7),
            TopKLogitsWarper(20),
            TopPLogitsWarper(0.8),
            MinPLogitsWarper(0.05),
            TypicalLogitsWarper(0.9),
        ],
    ),
    (sampler(), []),
    (greedy(top_k=3, top_p=0.1), []),  # greedy rows are never warped
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_warpers_keep_exactly_hfs_support(seed: int) -> None:
    logits = random_logits(len(WARPER_CASES), seed)
    empty: list[list[int]] = [[] for _ in WARPER_CASES]
    ours = run([c[0] for c in WARPER_CASES], logits, empty, empty)
    for r, (_, warpers) in enumerate(WARPER_CASES):
        assert_rows_match(ours[r], hf_row(warpers, [], [], logits[r]))


def test_beam_sample_rows_keep_eos_plus_one() -> None:
    """HF's min_tokens_to_keep for beam sampling is (#EOS ids + 1): a beam can always continue."""
    params = DecodingParams(num_beams=2, do_sample=True, top_k=1, top_p=0.01, stop_token_ids=(4,))
    logits = random_logits(1, 7)
    ours = run([params], logits, [[]], [[]])
    keep = 3  # EOS 2, stop id 4, plus one
    hf = hf_row(
        [
            TopKLogitsWarper(1, min_tokens_to_keep=keep),
            TopPLogitsWarper(0.01, min_tokens_to_keep=keep),
        ],
        [],
        [],
        logits[0].log_softmax(-1),
    )
    assert_rows_match(ours[0], hf)
    assert (~torch.isinf(ours[0])).sum() == keep


def test_unused_processors_cost_nothing() -> None:
    params = [greedy(), greedy(), DecodingParams(temperature=0.0, top_k=5)]
    t = SamplingTensors.from_rows(params, [[1, 2]] * 3, [[3]] * 3, EOS, V, "cpu")
    assert t.processors.empty and t.warpers is None and t.beam_rows is None and t.all_greedy
    logits = random_logits(3, 8)
    assert process_logits(logits, t).data_ptr() == logits.data_ptr()  # not even a copy
    params = [sampler(top_p=0.9), greedy(), sampler(top_p=0.5, temperature=0.5), sampler()]
    t = SamplingTensors.from_rows(params, [[1]] * 4, [[1]] * 4, EOS, V, "cpu")
    assert t.warpers is not None and t.warpers.top_k is None and t.warpers.min_p is None
    assert t.warpers.top_p.rows.tolist() == [0, 2]  # only the rows that use it are sorted
    assert t.warpers.temperature.rows.tolist() == [2]
    logits = random_logits(4, 9)
    before = logits.clone()
    out = process_logits(logits, t)
    assert torch.equal(logits, before)  # the raw logits survive for logprobs
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


def test_out_of_vocabulary_ids_never_break_the_batch() -> None:
    params = [
        greedy(logit_bias={V + 5: 3.0}, bad_words_ids=((V + 1,),), repetition_penalty=1.2),
        greedy(),
    ]
    logits = random_logits(2, 9)
    ours = run(params, logits, [[V + 3, 1], [1]], [[2], [2]])
    assert not torch.isinf(ours).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_warpers_after_top_k_on_a_wide_vocabulary_match_hf(seed: int) -> None:
    """Small supports take the compact path (warpers run on the finite entries only)."""
    vocab = 2000
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((4, vocab), generator=g) * 3.0
    cases = [
        (sampler(top_k=50, top_p=0.7), [TopKLogitsWarper(50), TopPLogitsWarper(0.7)]),
        (
            sampler(top_k=20, min_p=0.2, temperature=0.8),
            [TemperatureLogitsWarper(0.8), TopKLogitsWarper(20), MinPLogitsWarper(0.2)],
        ),
        (sampler(top_k=100, typical_p=0.4), [TopKLogitsWarper(100), TypicalLogitsWarper(0.4)]),
        (sampler(top_p=0.5), [TopPLogitsWarper(0.5)]),  # no top-k: full sort
    ]
    params = [c[0] for c in cases]
    t = SamplingTensors.from_rows(params, [[]] * 4, [[]] * 4, EOS, vocab, "cpu")
    ours = process_logits(logits, t)
    for r, (_, warpers) in enumerate(cases):
        assert_rows_match(ours[r], hf_row(warpers, [], [], logits[r]))


@pytest.mark.parametrize("seed", range(4))
def test_rows_kept_in_a_penalty_table_process_scores_as_their_token_lists_do(seed: int) -> None:
    """Rows kept in a `PenaltyTable`, each made from a prefix of its tokens and then appended to
    token by token (as the engine's commits do), process scores exactly as the token lists do:
    over steps, with released rows' slots reused (queued appends of a released row dropped) and
    the table growing past its first slots and width."""
    rows, vocab = 12, 200  # more distinct tokens than the table's first width
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (6 + 9 * r,), generator=g).tolist() for r in range(rows)]
    outputs = [torch.randint(0, vocab, (5 + 3 * r,), generator=g).tolist() for r in range(rows)]
    choices = [
        DecodingParams(repetition_penalty=1.3, seed=1),
        DecodingParams(frequency_penalty=0.7, presence_penalty=0.4),
        DecodingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.5),
        DecodingParams(),
        DecodingParams(frequency_penalty=1.1, logit_bias={3: 2.0}),
        DecodingParams(repetition_penalty=1.2, presence_penalty=-0.3, no_repeat_ngram_size=2),
    ]
    params = [choices[r % len(choices)] for r in range(rows)]
    table = PenaltyTable("cpu")
    doomed = table.add([1, 2], [3])  # released with an append still queued: its slot is reused
    doomed.append(4)
    doomed.release()
    kept: list[PenaltyRow | None] = []
    for prompt, output in zip(prompts, outputs):
        kept.append(table.add(prompt, output[: len(output) // 2]))
    kept[3] = None  # a row without kept state: its lists are read
    assert table.tokens.shape[0] >= rows and table.tokens.shape[1] > 64  # it grew
    for step in range(3):  # the second half of each output, then two more tokens
        if step == 0:
            for r, state in enumerate(kept):
                for token in outputs[r][len(outputs[r]) // 2 :]:
                    if state is not None:
                        state.append(token)
        else:
            for r, state in enumerate(kept):
                token = int(torch.randint(0, vocab, (), generator=g))
                outputs[r].append(token)
                if state is not None:
                    state.append(token)
        logits = torch.randn((rows, vocab), generator=g) * 2.0
        rebuilt = SamplingTensors.from_rows(params, prompts, outputs, EOS, vocab, "cpu")
        from_kept = SamplingTensors.from_rows(
            params, prompts, outputs, EOS, vocab, "cpu", penalty_rows=kept
        )
        assert torch.equal(process_logits(logits, from_kept), process_logits(logits, rebuilt))
    assert from_kept.processors.kept is not None  # the same entries through a strided view:
    strided = logits.t().contiguous().t()
    assert not strided.is_contiguous()
    from_kept.processors.kept.apply_(strided)
    flat = logits.clone()
    from_kept.processors.kept.apply_(flat)
    assert torch.equal(strided, flat)
    assert table.rows_held == rows - 1
    for state in kept:
        if state is not None:
            state.release()
    assert table.rows_held == 0
