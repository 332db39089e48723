"""model/seq2seq/runner.py's `decoder_part`: the decoder's share of a step that also writes
sources keeps each row's decoder tokens and the step's own fields, and drops what `execute`
already did."""

from __future__ import annotations

import pytest

from server.model.seq2seq.runner import decoder_part
from server.step_plan import PlanScore, SourceEncode, StepPlan, TableEdit


def mixed_plan() -> StepPlan:
    """Row 0: the first 4 of its 6 source positions (a chunk, no sample); row 1: its last 2
    source positions and its decoder's start; row 2: a decode step past its source of 3."""
    return StepPlan(
        row_ids=[10, 11, 12],
        starts=[0, 3, 7],
        num_new=[4, 3, 1],
        num_drafts=[0, 0, 0],
        samples=[False, True, True],
        tokens=[1, 2, 3, 4, 5, 6, 99, 42],
        table_edits=[TableEdit(row=0, keep=0, blocks=[0, 1])],
        released=[7],
        copies=[(3, 4)],
        source_lens=[6, 5, 3],
        source_groups=[0, 1, 1],
        encodes=[SourceEncode(row=0, source=[1, 2, 3, 4, 5, 6])],
        aligns=[0, 2],  # row 0's step is all source: nothing of it to align yet
        ranked=8,
    )


def test_keeps_the_decoder_tokens_and_the_steps_own_fields() -> None:
    plan = mixed_plan()
    part, kept = decoder_part(plan, plan.source_lens or [])
    assert kept == [1, 2]
    assert part.row_ids == [11, 12]
    assert part.starts == [5, 7]  # row 1 from its source's end
    assert part.num_new == [1, 1]
    assert part.tokens == [99, 42]
    assert part.samples == [True, True] and part.num_drafts == [0, 0]
    assert part.source_lens == [5, 3] and part.source_groups == [1, 1]
    assert part.aligns == [1]  # row 2, the part's second
    assert part.ranked == 8  # a field of the step, carried as it is
    # done by `execute` before the decoder runs: not done twice
    assert (part.table_edits, part.released, part.copies, part.encodes) == ([], [], [], [])


def test_a_row_that_samples_inside_its_source_is_an_error() -> None:
    plan = mixed_plan()
    plan.samples[0] = True
    with pytest.raises(RuntimeError, match="samples inside its source"):
        decoder_part(plan, plan.source_lens or [])


def test_row_indexed_fields_an_encoder_decoder_step_never_has_stop_it() -> None:
    plan = mixed_plan()
    plan.scores = [PlanScore(row=2, start=0, stop=1, num_top=0, targets=[5])]
    with pytest.raises(RuntimeError, match="scores"):
        decoder_part(plan, plan.source_lens or [])
