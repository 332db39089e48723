"""A step plan split by the model that runs each row, and the parts' outputs merged back.

When requests name different models of one server (engine/fusion.py), one engine step still
plans every running row once; each model then runs the rows of its requests. `subset_plan` is
what one model reads of the step: its rows' columns, tokens, edits, scores, sources and deferred
tokens, reindexed, and every release and block copy (both are in the block ids all the models'
pools share). `merge_outputs` puts the parts' logits rows back in the step's order.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate

import torch

from server.step_plan import DeferredTokens, StepOutput, StepPlan, TableEdit


def logits_starts(plan: StepPlan) -> list[int]:
    """Index of each row's first logits row in the step's output (1 + drafts per sampling row),
    and the total at the end."""
    return [0, *accumulate((1 + d) * s for d, s in zip(plan.num_drafts, plan.samples))]


def subset_plan(plan: StepPlan, rows: list[int]) -> tuple[StepPlan, list[int]]:
    """The part of `plan` that runs `rows` (indices into its rows, ascending), and the step's
    logits rows that the part's logits rows are, in order. A request's rows run on one model:
    its first row, which groups its source, is among `rows` whenever another of its rows is."""
    index = {r: i for i, r in enumerate(rows)}
    starts, first_logits = plan.token_starts(), logits_starts(plan)
    logits_rows = [j for r in rows for j in range(first_logits[r], first_logits[r + 1])]
    logits_index = {j: i for i, j in enumerate(logits_rows)}
    deferred = plan.deferred
    if deferred is not None:
        kept = [j for j, r in enumerate(deferred.rows) if r in index]
        deferred = (
            DeferredTokens(
                deferred.values,
                [index[deferred.rows[j]] for j in kept],
                [deferred.sources[j] for j in kept],
            )
            if kept
            else None
        )
    part = StepPlan(
        row_ids=[plan.row_ids[r] for r in rows],
        starts=[plan.starts[r] for r in rows],
        num_new=[plan.num_new[r] for r in rows],
        num_drafts=[plan.num_drafts[r] for r in rows],
        samples=[plan.samples[r] for r in rows],
        tokens=[t for r in rows for t in plan.tokens[starts[r] : starts[r] + plan.num_new[r]]],
        table_edits=[
            TableEdit(index[e.row], e.keep, e.blocks) for e in plan.table_edits if e.row in index
        ],
        released=plan.released,
        copies=plan.copies,
        scores=[dataclasses.replace(s, row=index[s.row]) for s in plan.scores if s.row in index],
        exact=[index[r] for r in plan.exact if r in index],
        exact_logits=[logits_index[j] for j in plan.exact_logits if j in logits_index],
        lora_slots=None if plan.lora_slots is None else [plan.lora_slots[r] for r in rows],
        installs=plan.installs,
        deferred=deferred,
        source_lens=None if plan.source_lens is None else [plan.source_lens[r] for r in rows],
        source_groups=[index[plan.source_groups[r]] for r in rows] if plan.source_groups else [],
        encodes=[dataclasses.replace(e, row=index[e.row]) for e in plan.encodes if e.row in index],
        aligns=[index[r] for r in plan.aligns if r in index],
        ranked=plan.ranked,
    )
    return part, logits_rows


def merge_outputs(
    num_logits_rows: int, parts: list[tuple[list[int], list[int], StepOutput]]
) -> StepOutput:
    """One step's output from its parts: (the part's rows of the step, the step's logits rows
    that are the part's, its output) each. The logits take the first part's dtype and device;
    every part scores the same vocabulary."""
    first = parts[0][2].logits
    logits = first.new_empty((num_logits_rows, first.shape[-1]))
    merged = StepOutput(logits)
    for rows, logits_rows, output in parts:
        if logits_rows:
            at = torch.tensor(logits_rows, device=logits.device)
            logits.index_copy_(0, at, output.logits.to(logits.dtype))
        merged.scores.update({rows[i]: scored for i, scored in output.scores.items()})
        merged.cross_attention.update({rows[i]: a for i, a in output.cross_attention.items()})
    return merged
