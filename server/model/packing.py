"""Packing a step: every row's new tokens as one [1, T] sequence for the model.

With the paged-attention kernel, the whole step is one `PagedStep` (block tables and query tiles).
With the gather path, rows that add one token attend as one padded decode batch (`DecodeStep`) and
rows with a prompt chunk attend one by one over their gathered history (`SeqSlice`); its
decode-only steps take the faster path in runner.py and never come here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decoding.logprobs import TokenLogprobs, token_logprobs
from decoding.transfer import to_device
from server.model.attention import DecodeStep, PagedStep, SeqSlice, StepContext
from server.work import NO_ADAPTER, DeferredTokens, Row, WorkItem


@dataclass
class PackedStep:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    ctx: StepContext | PagedStep
    sample_rows: list[int]  # packed indexes of the logits rows of the items that sample, in order
    sample_index: torch.Tensor  # the same on the device
    item_starts: list[int]  # packed index of each item's first token


def decode_inputs(rows: Sequence[Row]) -> tuple[list[list[int]], list[int], list[int]]:
    """Block tables, new tokens and their positions of rows that add one token each."""
    return (
        [r.block_table for r in rows],
        [r.token_ids[r.num_computed] for r in rows],
        [r.num_computed for r in rows],
    )


def verify_inputs(
    items: Sequence[WorkItem[Row]],
) -> tuple[list[list[int]], list[int], list[int]]:
    """`decode_inputs` of rows that add their pending token and their drafts: each draft is one
    more query row of the decode batch, with the row's block table and its own position. Every
    layer writes the step's keys and values before it attends, so a draft's query sees the
    drafts before it."""
    tables: list[list[int]] = []
    tokens: list[int] = []
    positions: list[int] = []
    for item in items:
        seq, start = item.seq, item.seq.num_computed
        tables += [seq.block_table] * item.num_new
        tokens += [seq.token_ids[start], *item.draft]
        positions += range(start, start + item.num_new)
    return tables, tokens, positions


@dataclass
class ScratchRow:
    """A row that only runs before serving (warm-up): its tokens sit on the pool's first blocks,
    which no sequence owns yet."""

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    lora_slot: int = NO_ADAPTER


def scratch_item(num_new: int, block_size: int) -> WorkItem[ScratchRow]:
    """A prompt chunk of `num_new` tokens (one: a decode row) on a `ScratchRow`."""
    blocks = list(range(-(-num_new // block_size)))
    return WorkItem(ScratchRow([0] * num_new, 0, blocks), num_new)


def scratch_decode(
    rows: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
    """Inputs of a decode step of `rows` rows on the slots of block 0 (before serving: no
    sequence owns it yet)."""
    positions = list(range(1, rows + 1))
    ctx = DecodeStep.build([[0]] * rows, [p + 1 for p in positions], block_size, device)
    input_ids = torch.zeros((1, rows), dtype=torch.long, device=device)
    return input_ids, to_device(positions, device, torch.long).unsqueeze(0), ctx


def put_deferred(
    input_ids: torch.Tensor, items: Sequence[WorkItem[Row]], deferred: DeferredTokens | None
) -> None:
    """Write the step's `deferred` tokens into its flat input ids [T] (each item's new tokens,
    in item order), on the device: nothing is read back."""
    if deferred is None:
        return
    starts, total = [], 0
    for item in items:
        starts.append(total)
        total += item.num_new
    at = to_device([starts[i] for i in deferred.items], input_ids.device, torch.long)
    source = to_device(deferred.sources, input_ids.device, torch.long)
    input_ids.index_copy_(0, at, deferred.values.index_select(0, source))


def slots(table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start, stop) of a row with block table `table`."""
    pos = torch.arange(start, stop)
    blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
    return blocks * block_size + pos % block_size


def pack_step(
    items: Sequence[WorkItem[Row]], block_size: int, device: torch.device, *, kernel: bool = False
) -> PackedStep:
    """The step's tokens and positions, and the attention context of the chosen path."""
    tokens: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    item_starts: list[int] = []
    for item in items:
        seq, start = item.seq, item.seq.num_computed
        item_starts.append(len(tokens))
        new = seq.token_ids[start : start + item.num_new]
        if item.draft:
            new += item.draft
        tokens += new
        positions += range(start, start + item.num_new)
        if item.samples:  # the last token and each draft predict the token after them
            sample_rows.extend(range(len(tokens) - 1 - len(item.draft), len(tokens)))
    ctx: StepContext | PagedStep
    if kernel:
        ctx = PagedStep.build(
            [item.seq.block_table for item in items],
            [item.seq.num_computed for item in items],
            [item.num_new for item in items],
            block_size,
            device,
        )
    else:
        ctx = _gather_context(items, item_starts, block_size, device)
    return PackedStep(
        to_device(tokens, device, torch.long).unsqueeze(0),
        to_device(positions, device, torch.long).unsqueeze(0),
        ctx,
        sample_rows,
        to_device(sample_rows, device, torch.long),
        item_starts,
    )


def _gather_context(
    items: Sequence[WorkItem[Row]], item_starts: list[int], block_size: int, device: torch.device
) -> StepContext:
    """One-token rows as one padded `DecodeStep`, chunks one `SeqSlice` each, over their
    gathered histories."""
    slot_parts: list[torch.Tensor] = []
    decode_rows: list[tuple[int, Row]] = []  # (packed index, row) of one-token rows
    prefill: list[SeqSlice] = []
    for item, first in zip(items, item_starts):
        seq, start = item.seq, item.seq.num_computed
        stop = start + item.num_new
        if item.num_new == 1:
            slot_parts.append(slots(seq.block_table, start, stop, block_size))
            decode_rows.append((first, seq))
        else:
            history = slots(seq.block_table, 0, stop, block_size)
            slot_parts.append(history[start:])
            prefill.append(SeqSlice(first, item.num_new, stop, to_device(history, device)))
    decode = None
    decode_index = None
    if decode_rows:
        rows = [row for _, row in decode_rows]
        tables = [r.block_table for r in rows]
        decode = DecodeStep.build(tables, [r.num_computed + 1 for r in rows], block_size, device)
        decode_index = to_device([i for i, _ in decode_rows], device, torch.long)
    return StepContext(
        slot_mapping=to_device(torch.cat(slot_parts), device),
        decode=decode,
        decode_index=decode_index,
        prefill=prefill,
        device=device,
    )


SCORE_CHUNK = 64  # positions whose logits exist at once while scoring a prompt


def score_positions(
    hidden: torch.Tensor,
    packed: PackedStep,
    i: int,
    item: WorkItem[Row],
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> TokenLogprobs | None:
    """Logprobs of the tokens that follow positions item.score.start..stop-1 of item `i`, the LM
    head (`logits_of`) run on SCORE_CHUNK positions at a time, each part reduced at once. None on
    a tensor-parallel follower rank, whose LM head gives no rows (the driver reduces)."""
    span, seq = item.score, item.seq
    assert span is not None
    first = packed.item_starts[i] + span.start - seq.num_computed
    targets = seq.token_ids[span.start + 1 : span.stop + 1]
    parts = []
    for a in range(0, len(targets), SCORE_CHUNK):
        b = min(a + SCORE_CHUNK, len(targets))
        logits = logits_of(hidden[first + a : first + b])
        if not len(logits):
            continue
        parts.append(token_logprobs(logits, targets[a:b], num_top=span.num_top, with_ranks=True))
    return TokenLogprobs.cat(parts) if parts else None
