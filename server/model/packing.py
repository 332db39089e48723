"""Packing a step: every row's new tokens as one [1, T] sequence for the model.

With the paged-attention kernel, the whole step is one `PagedStep` (block tables and query tiles).
With the gather path, rows that add one token attend as one padded decode batch (`DecodeStep`) and
rows with a prompt chunk attend one by one over their gathered history (`SeqSlice`); its
decode-only steps take the faster path in runner.py and never come here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from server.model.attention import DecodeStep, PagedStep, SeqSlice, StepContext
from server.work import Row, WorkItem


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


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as a long tensor on `device`. On CUDA the copy comes from pinned memory and
    does not block the host: a plain copy waits for every queued kernel, which would end the
    overlap of the host's work with the forward (engine.py) before it began."""
    tensor = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


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
        to_device(tokens, device).unsqueeze(0),
        to_device(positions, device).unsqueeze(0),
        ctx,
        sample_rows,
        to_device(sample_rows, device),
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
            prefill.append(SeqSlice(first, item.num_new, stop, history.to(device)))
    decode = None
    decode_index = None
    if decode_rows:
        rows = [row for _, row in decode_rows]
        tables = [r.block_table for r in rows]
        decode = DecodeStep.build(tables, [r.num_computed + 1 for r in rows], block_size, device)
        decode_index = torch.tensor([i for i, _ in decode_rows], device=device)
    return StepContext(
        slot_mapping=torch.cat(slot_parts).to(device),
        decode=decode,
        decode_index=decode_index,
        prefill=prefill,
        device=device,
    )
