"""Speculation inside the continuous batch: which rows draft, and what a step keeps.

Before a step the scheduler asks its drafter for the drafts of the rows that decode: here n-gram
lookup (`Speculator`; decoding/speculation.py: prompt lookup over the row's own tokens, a per-row
draft length that adapts and switches itself off when drafts are rejected), or a draft model
(draft_model.py), which verification treats the same way. The row's step then computes its pending
token and its drafts (`WorkItem.draft`), with logits at each of those positions. After the forward,
`VerifyBatch` turns each drafted row into one *position* per logits row, each seeing the drafts
before it as output (penalties count them, a constrained row's grammar has consumed them), so the
ordinary sampling step chooses a token at every position; the row keeps the drafts up to the first
that differs from the token chosen there, plus that token.

Which rows draft:
- greedy and sampled rows, with logprobs, penalties, stop strings and grammars (a constrained row
  only drafts what its grammar allows; each position gets its own copy of the grammar state);
- not beam rows: a beam search must score every beam's candidates at every step, and its beams are
  re-forked at each one, so there is no single continuation to verify;
- every row draws its i-th output token with number i of its own random stream, a draft position
  too (decoding/random_streams.py), so a seeded request's tokens, `n` and `best_of` included, are
  the same with speculation on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoding.constraints import TokenConstraint
from decoding.penalty_table import PenaltyRow, PenaltyTable
from decoding.row_tensors import KeptRowTensors
from decoding.speculation import DraftLength, RowDrafts, accepted_length
from decoding.transfer import to_device
from server.engine.block_pool import BlockPool
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.engine.sampling_step import Choices, PendingChoices, choose_on_device
from server.engine.work import WorkItem


@dataclass(eq=False, slots=True)
class DraftPosition:
    """The position after a row's first j drafts, as the sampling step reads a row."""

    request: EngineRequest
    output_ids: list[int]
    constraint: TokenConstraint | None
    stream_key: int  # its row's: the position draws number len(output_ids) of that stream
    penalties: PenaltyRow | None = None  # always None: a draft position is made per step,
    # its penalties read `output_ids`

    @property
    def num_output(self) -> int:
        return len(self.output_ids)


@dataclass
class RowOutcome:
    tokens: list[int]  # the accepted drafts and the token chosen after them
    logprobs: list[TokenLogprob | None]
    drafted: int
    accepted: int
    no_token: bool = False  # a constrained row had nothing left to choose after `tokens`


def can_draft(item: WorkItem) -> bool:
    """Whether a step's item may take drafts: a row that decodes one token after its first
    output, scores nothing, and is neither a beam (its beams re-fork at every step) nor fused
    (its companion's scores are needed before a token is chosen)."""
    seq = item.seq
    if item.num_new != 1 or not item.samples or not seq.num_output or item.score:
        return False
    return seq.request.search is None and seq.request.params.lm_fusion is None


def legal_prefix(seq: Sequence, state: RowDrafts, draft: list[int]) -> list[int]:
    """The drafts of a constrained row its grammar allows, keeping its state after each one."""
    states: list[TokenConstraint] = []
    current = seq.constraint
    assert current is not None
    for j, token in enumerate(draft):
        if token in seq.request.finishing_ids:  # it ends the row: nothing after it matters
            state.constraints = states
            return draft[: j + 1]
        current = current.fork()
        if not current.advance(token):
            draft = draft[:j]
            break
        states.append(current)
    state.constraints = states
    return draft


def add_drafts(
    items: list[WorkItem],
    budget: int,
    pool: BlockPool,
    propose: Callable[[Sequence, int], list[int]],
) -> None:
    """Drafts for the items that may take them (`propose`: a row's drafts, at most the count
    given), in the budget and the blocks left once everything else of the step has its share
    (drafts never preempt or delay anyone)."""
    added = 0
    for item in items:
        if not can_draft(item):
            continue
        seq = item.seq
        draft = propose(seq, budget - added)
        if not draft:
            continue
        draft = draft[: fitting_drafts(pool, seq, len(draft))]
        if draft:
            pool.grow(seq.block_table, seq.num_computed + 1 + len(draft))  # private: no copies
            item.draft = draft
            item.num_new += len(draft)
            added += len(draft)


def fitting_drafts(pool: BlockPool, seq: Sequence, count: int) -> int:
    """How many of `count` drafts after a row's pending token the pool can hold: all when the
    free blocks suffice, else those that fit the row's last block."""
    if pool.blocks_needed(seq.block_table, seq.num_computed + 1 + count) <= pool.num_free:
        return count
    return min(count, len(seq.block_table) * pool.block_size - seq.num_computed - 1)


def draft_room(seq: Sequence, length: int, budget: int, max_model_len: int) -> int:
    """How many drafts a row may take now: its draft length, the step's budget left, and room
    for the token kept after them within `max_tokens` and the model's length."""
    return min(
        budget,
        length,
        seq.request.params.max_tokens - seq.num_output - 1,
        max_model_len - len(seq.token_ids) - 1,
    )


class Speculator:
    """N-gram drafts: prompt lookup over each row's own tokens."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        self.num_tokens = num_tokens  # most drafts per row per step
        self.max_model_len = max_model_len

    def add(
        self, items: list[WorkItem], budget: int, pool: BlockPool, copies: list[tuple[int, int]]
    ) -> None:
        add_drafts(items, budget, pool, self.propose)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a row about to decode one token, at most `room` (the step's budget)."""
        state = seq.drafts
        if state is None:
            state = seq.drafts = RowDrafts(DraftLength(self.num_tokens))
        if not state.length.drafts_now():
            return []
        room = draft_room(seq, state.length.length, room, self.max_model_len)
        draft = state.index.propose(seq.token_ids, room)
        if seq.constraint is not None and draft:
            draft = legal_prefix(seq, state, draft)
        return draft


class VerifyBatch:
    """The positions a step chooses tokens at: one per row without drafts, 1 + k per drafted
    row. `logits_index` picks each position's logits row from the step's output (None: as is)."""

    def __init__(
        self, items: list[WorkItem], rows: list[Sequence], row_items: list[int] | None
    ) -> None:
        self.rows = rows
        self.drafts = [items[i].draft for i in (row_items or range(len(rows)))]
        self.positions: list[Sequence | DraftPosition]
        if not any(self.drafts):  # the common step: one position per row, no loop over rows
            self.positions, self.starts = list(rows), list(range(len(rows)))
            self.logits_index = row_items
            return
        offsets, total = [], 0
        for item in items:
            offsets.append(total)
            total += 1 + len(item.draft)
        self.positions, self.starts = [], []
        logits_rows: list[int] = []
        for r, seq in enumerate(rows):
            i = row_items[r] if row_items is not None else r
            self.starts.append(len(self.positions))
            self.positions.append(seq)
            logits_rows.append(offsets[i])
            draft = self.drafts[r]
            if not draft:
                continue
            states = seq.drafts.constraints if seq.drafts is not None else []
            for j in range(1, len(draft) + 1):
                # none after a finishing draft: the row ends there, that position is never kept
                constraint = states[j - 1] if j <= len(states) else None
                self.positions.append(
                    DraftPosition(
                        seq.request, [*seq.output_ids, *draft[:j]], constraint, seq.stream_key
                    )
                )
                logits_rows.append(offsets[i] + j)
        identity = row_items is None and len(logits_rows) == total
        self.logits_index = None if identity else logits_rows

    def choose(
        self,
        logits: torch.Tensor,
        eos_ids: frozenset[int],
        kept: KeptRowTensors | None = None,
        table: PenaltyTable | None = None,
    ) -> tuple[PendingChoices, torch.Tensor]:
        """A token at every position, on the device (sampling_step.choose_on_device), and the
        positions' logits; `kept`: the engine's params-only tensors of the last step, `table`:
        its penalized rows' tokens."""
        if self.logits_index is not None:
            index = to_device(self.logits_index, logits.device, torch.long)
            logits = logits.index_select(0, index)
        return choose_on_device(self.positions, logits, eos_ids, kept, table), logits

    def span(self, rows: slice) -> slice:
        """The positions of rows `rows` (rows without drafts: beams)."""
        start = self.starts[rows.start]
        return slice(start, start + rows.stop - rows.start)

    def outcome(self, r: int, choices: Choices) -> RowOutcome:
        """What row `r` keeps: its drafts up to the first one the chosen tokens differ from, and
        the token chosen there."""
        draft, start, seq = self.drafts[r], self.starts[r], self.rows[r]
        if not draft:  # a plain row: its one chosen token, or none
            if start in choices.no_token:
                return RowOutcome([], [], 0, 0, no_token=True)
            return RowOutcome([choices.tokens[start]], [choices.logprobs.get(start)], 0, 0)
        chosen = choices.tokens[start : start + len(draft) + 1]
        accepted = accepted_length(chosen, draft)
        kept = accepted + 1
        ends = [j for j in range(kept) if start + j in choices.no_token]
        no_token = bool(ends)
        if no_token:  # the kept tokens before that position were all drafts
            kept = accepted = ends[0]
        finishing = seq.request.finishing_ids
        kept = next((j + 1 for j in range(kept) if chosen[j] in finishing), kept)
        if seq.drafts is not None:
            seq.drafts.length.record(len(draft), accepted)
        return RowOutcome(
            chosen[:kept],
            [choices.logprobs.get(start + j) for j in range(kept)],
            drafted=len(draft),
            accepted=accepted,
            no_token=no_token,
        )
