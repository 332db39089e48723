"""N-gram speculation inside the continuous batch: which rows draft, and what a step keeps.

Before a step the scheduler asks `Speculator.propose` for the drafts of each row that decodes
(decoding/speculation.py: prompt lookup over the row's own tokens, a per-row draft length that
adapts and switches itself off when drafts are rejected). The row's step then computes its pending
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

from dataclasses import dataclass

import torch

from decoding.constraints import TokenConstraint
from decoding.penalty_table import PenaltyRow, PenaltyTable
from decoding.row_tensors import KeptRowTensors
from decoding.speculation import DraftLength, RowDrafts, accepted_length
from decoding.transfer import to_device
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


class Speculator:
    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        self.num_tokens = num_tokens  # most drafts per row per step
        self.max_model_len = max_model_len

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a row about to decode one token, at most `room` (the step's budget)."""
        req = seq.request
        if req.search is not None or req.params.lm_fusion is not None:  # its companion: no drafts
            return []
        state = seq.drafts
        if state is None:
            state = seq.drafts = RowDrafts(DraftLength(self.num_tokens))
        if not state.length.drafts_now():
            return []
        room = min(
            room,
            state.length.length,
            req.params.max_tokens - seq.num_output - 1,  # the kept token after them still fits
            self.max_model_len - len(seq.token_ids) - 1,
        )
        draft = state.index.propose(seq.token_ids, room)
        if seq.constraint is not None and draft:
            draft = self._legal_prefix(seq, state, draft)
        return draft

    @staticmethod
    def _legal_prefix(seq: Sequence, state: RowDrafts, draft: list[int]) -> list[int]:
        """The drafts the row's grammar allows, keeping its state after each one."""
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
