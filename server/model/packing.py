"""Packing a step: every row's new tokens as one [1, T] sequence for the model.

With the paged-attention kernel, the whole step is one `PagedStep` (block tables and query tiles).
With the gather path, rows that add one token attend as one padded decode batch (`DecodeStep`) and
rows with a prompt chunk attend one by one over their gathered history (`SeqSlice`); its
decode-only steps take the faster path in runner.py and never come here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.logprobs import TokenLogprobs, token_logprobs
from decoding.transfer import to_device
from server.model.kv_cache import PagedKVCache
from server.model.paged_step import PagedStep
from server.model.step_context import CrossStep, DecodeStep, SeqSlice, StepContext
from server.step_plan import PlanScore, StepPlan, TableEdit


@dataclass
class PackedStep:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    ctx: StepContext | PagedStep
    sample_rows: list[int]  # packed indexes of the logits rows of the rows that sample, in order
    sample_index: torch.Tensor  # the same on the device
    row_starts: list[int]  # packed index of each row's first token


def decode_inputs(
    plan: StepPlan, tables: list[list[int]]
) -> tuple[list[list[int]], list[int], list[int]]:
    """Block tables, new tokens and their positions of rows that add one token each."""
    return tables, plan.tokens, plan.starts


def verify_inputs(
    plan: StepPlan, tables: list[list[int]]
) -> tuple[list[list[int]], list[int], list[int]]:
    """`decode_inputs` of rows that add their pending token and their drafts: each draft is one
    more query row of the decode batch, with the row's block table and its own position. Every
    layer writes the step's keys and values before it attends, so a draft's query sees the
    drafts before it."""
    row_tables: list[list[int]] = []
    positions: list[int] = []
    for table, start, n in zip(tables, plan.starts, plan.num_new):
        row_tables += [table] * n
        positions += range(start, start + n)
    return row_tables, plan.tokens, positions


def standalone_plan(lengths: list[int], tables: list[list[int]]) -> StepPlan:
    """A step of whole prompts of `lengths` tokens (zeros) on `tables` (full table edits): the
    warm-up's and the memory profile's, run before serving and never kept (ids below 0)."""
    ids = [-1 - r for r in range(len(lengths))]
    return StepPlan(
        row_ids=ids,
        starts=[0] * len(lengths),
        num_new=list(lengths),
        num_drafts=[0] * len(lengths),
        samples=[True] * len(lengths),
        tokens=[0] * sum(lengths),
        table_edits=[TableEdit(r, 0, list(t)) for r, t in enumerate(tables)],
    )


def scratch_plan(num_new: int, block_size: int) -> StepPlan:
    """A prompt chunk of `num_new` tokens (one: a decode row) on the pool's first blocks, which
    no sequence owns yet (warm-up, before serving)."""
    return standalone_plan([num_new], [list(range(-(-num_new // block_size)))])


def scratch_decode(
    rows: int,
    block_size: int,
    device: torch.device,
    block: int = 0,
    kv: PagedKVCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
    """Inputs of a decode step of `rows` rows on the slots of `block` (one no sequence owns:
    the pool's spare block, or any before serving); `kv`: the pools the step is given (a
    compiled step's example)."""
    positions = list(range(1, rows + 1))
    ctx = DecodeStep.build([[block]] * rows, [p + 1 for p in positions], block_size, device)
    ctx.kv = kv
    input_ids = torch.zeros((1, rows), dtype=torch.long, device=device)
    return input_ids, to_device(positions, device, torch.long).unsqueeze(0), ctx


def put_deferred(input_ids: torch.Tensor, plan: StepPlan, row_starts: list[int]) -> None:
    """Write the plan's deferred tokens into its flat input ids [T] (each row's new tokens, in
    row order; `row_starts`: where each row's begin), on the device: nothing is read back."""
    deferred = plan.deferred
    if deferred is None:
        return
    at = to_device([row_starts[i] for i in deferred.rows], input_ids.device, torch.long)
    source = to_device(deferred.sources, input_ids.device, torch.long)
    input_ids.index_copy_(0, at, deferred.values.index_select(0, source))


def slots(table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start, stop) of a row with block table `table`."""
    pos = torch.arange(start, stop)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def pack_step(
    plan: StepPlan,
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    kernel: bool = False,
    pad_cross: bool = False,
) -> PackedStep:
    """The step's tokens and positions, and the attention context of the chosen path (`kernel`:
    the paged kernel's; else gather, where encoder-decoder rows have the plan's `source_lens`);
    `pad_cross`: their cross-attention padded for a compiled step (CrossStep.build)."""
    positions: list[int] = []
    sample_rows: list[int] = []
    row_starts = plan.token_starts()
    for first, start, n, drafts, samples in zip(
        row_starts, plan.starts, plan.num_new, plan.num_drafts, plan.samples
    ):
        positions += range(start, start + n)
        if samples:  # the last token and each draft predict the token after them
            sample_rows.extend(range(first + n - 1 - drafts, first + n))
    ctx: StepContext | PagedStep
    if kernel:
        ctx = PagedStep.build(tables, plan.starts, plan.num_new, block_size, device)
    else:
        ctx = _gather_context(
            plan, tables, row_starts, block_size, device, plan.source_lens, pad_cross
        )
    return PackedStep(
        to_device(plan.tokens, device, torch.long).unsqueeze(0),
        to_device(positions, device, torch.long).unsqueeze(0),
        ctx,
        sample_rows,
        to_device(sample_rows, device, torch.long),
        row_starts,
    )


def _gather_context(
    plan: StepPlan,
    tables: list[list[int]],
    row_starts: list[int],
    block_size: int,
    device: torch.device,
    source_lens: list[int] | None = None,
    pad_cross: bool = False,
) -> StepContext:
    """One-token rows as one padded `DecodeStep`, chunks one `SeqSlice` each, over their
    gathered histories."""
    slot_mapping: list[int] = []  # each packed token's slot
    decode_index: list[int] = []  # packed index of each one-token row
    decode_tables: list[list[int]] = []
    decode_lengths: list[int] = []
    decode_sources: list[int] = []
    prefill: list[SeqSlice] = []
    decode_rows: list[int] = []
    sources = source_lens or itertools.repeat(0)  # decoder-only rows: no source
    aligned = set(plan.aligns)  # kept as slices, even of one token: their scores are read
    for row, (table, first, start, n, source) in enumerate(
        zip(tables, row_starts, plan.starts, plan.num_new, sources)
    ):
        stop = start + n
        if n == 1 and row not in aligned:
            decode_rows.append(row)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
            decode_index.append(first)
            decode_tables.append(table)
            decode_lengths.append(stop)
            decode_sources.append(source)
        else:
            history = slots(table, 0, stop, block_size)
            slot_mapping += history[start:].tolist()
            gathered = to_device(history, device)
            prefill.append(SeqSlice(first, n, stop, gathered, source, row in aligned))
    decode = None
    index = None
    if decode_index:
        index = to_device(decode_index, device, torch.long)
        if source_lens is None:
            decode = DecodeStep.build(decode_tables, decode_lengths, block_size, device)
        else:  # self-attention over the decoder's positions, cross-attention over the source's
            decode = DecodeStep.build(
                decode_tables, decode_lengths, block_size, device, first=decode_sources
            )
            groups = [plan.source_groups[r] for r in decode_rows] if plan.source_groups else None
            decode.cross = CrossStep.build(
                decode_tables, decode_sources, block_size, device, groups, pad_cross
            )
    per_token = None
    if source_lens is not None:
        counts = torch.tensor(plan.num_new)
        per_token = to_device(torch.repeat_interleave(torch.tensor(source_lens), counts), device)
    return StepContext(
        slot_mapping=to_device(slot_mapping, device, torch.long),
        decode=decode,
        decode_index=index,
        prefill=prefill,
        device=device,
        source_lens=per_token,
        cross_scores={} if aligned else None,
    )


SCORE_CHUNK = 64  # positions whose logits exist at once while scoring a prompt


def score_positions(
    hidden: torch.Tensor,
    packed: PackedStep,
    plan: StepPlan,
    score: PlanScore,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> TokenLogprobs | None:
    """Logprobs of `score.targets`, the tokens that follow positions score.start..stop-1 of its
    row, the LM head (`logits_of`) run on SCORE_CHUNK positions at a time, each part reduced at
    once. None on a tensor-parallel follower rank, whose LM head gives no rows (the driver
    reduces)."""
    first = packed.row_starts[score.row] + score.start - plan.starts[score.row]
    targets = score.targets
    parts = []
    for a in range(0, len(targets), SCORE_CHUNK):
        b = min(a + SCORE_CHUNK, len(targets))
        logits = logits_of(hidden[first + a : first + b])
        if not len(logits):
            continue
        parts.append(token_logprobs(logits, targets[a:b], num_top=score.num_top, with_ranks=True))
    return TokenLogprobs.cat(parts) if parts else None
