"""The penalties' view of every penalized row, kept on the device from step to step.

The repetition penalty reads a row's distinct tokens (prompt and output); presence and frequency
read its distinct output tokens with their counts. Rebuilt from the row's token list at every
step that is O(history) of Python per row (for 256 rows of 1,000 tokens, 55 ms a step); copied
from kept host arrays it is still O(history) of copying per step. Here each penalized row owns a
slot of two tensors that live between steps: `tokens[slot, j]`, its j-th distinct token, and
`counts[slot, j]`, how often it was output. A step writes only what its rows appended (one
scatter for every row), and the penalties are applied with one gather and one scatter over the
rows' slots (`TablePenalties`, processors.py's `apply_processors_`).

The host keeps, per row (`PenaltyRow`), where each of its tokens sits, so an appended token is a
dictionary lookup. A released row's slot is reused; writes still queued for it are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.transfer import to_device


class PenaltyRow:
    """One row's place in a `PenaltyTable`: its slot and the column of each distinct token."""

    __slots__ = ("table", "slot", "columns")

    def __init__(self, table: PenaltyTable, slot: int, columns: dict[int, int]) -> None:
        self.table = table
        self.slot: int | None = slot  # None once released
        self.columns = columns

    def append(self, token: int) -> None:
        """The row output `token`: counted, and seen from now on."""
        self.table.append(self, token)

    def release(self) -> None:
        self.table.release(self)

    def __del__(self) -> None:  # a row dropped without release (a replaced beam) frees its slot
        self.release()


@dataclass
class TablePenalties:
    """A step's penalties for the rows kept in a table: gathered once per step."""

    rows: torch.Tensor  # [P] long: the rows of the step's scores
    # [P, W]: each row's distinct tokens and their output counts; past a row's length its last
    # entry again, so a padding entry computes and writes exactly what that entry does
    tokens: torch.Tensor  # long
    counts: torch.Tensor  # float64
    repetition: torch.Tensor  # [P, 1] float32 (1.0: none)
    frequency: torch.Tensor  # [P, 1] float64
    presence: torch.Tensor  # [P, 1] float64

    def apply_(self, scores: torch.Tensor) -> None:
        """The repetition penalty on every distinct token, then presence and frequency on the
        output ones, as processors.py's pairs would apply them (the same float operations)."""
        # only these entries are read and written (a copy of the rows' scores would cost [P, V]),
        # through flat indices where the scores are contiguous: half the time of a 2-D index
        rows = self.rows.unsqueeze(1)
        flat = None
        if scores.is_contiguous():
            flat = (rows * scores.shape[1] + self.tokens).view(-1)
            old = scores.view(-1).index_select(0, flat).view_as(self.tokens)
        else:
            old = scores[rows, self.tokens]
        new = torch.where(old < 0, old * self.repetition, old / self.repetition)
        penalty = (self.frequency * self.counts + self.presence).float()
        new = torch.where(self.counts > 0, new + -penalty, new)
        if flat is not None:
            scores.view(-1).index_copy_(0, flat, new.view(-1))
        else:
            scores[rows.expand_as(self.tokens), self.tokens] = new


class PenaltyTable:
    """Slots of distinct tokens and output counts for every penalized row, on one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.tokens = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.counts = torch.zeros((0, 0), dtype=torch.float64, device=self.device)
        self.lengths: list[int] = []
        self._free: list[int] = []
        # (row, column, token): one per output token, the token -1 after its first output
        self._queued: list[tuple[PenaltyRow, int, int]] = []

    @property
    def rows_held(self) -> int:
        return len(self.lengths) - len(self._free)

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> PenaltyRow:
        """A row's slot, filled with its tokens so far (the one O(history) moment of a row)."""
        columns: dict[int, int] = {}
        counts: list[float] = []
        for token in prompt_ids:
            if token not in columns:
                columns[token] = len(counts)
                counts.append(0.0)
        for token in output_ids:
            j = columns.get(token)
            if j is None:
                columns[token] = len(counts)
                counts.append(1.0)
            else:
                counts[j] += 1.0
        slot = self._free.pop() if self._free else self._new_slot()
        self._fit(len(counts))
        n = len(counts)
        self.tokens[slot, :n] = to_device(list(columns), self.device, torch.long)
        self.counts[slot, :n] = to_device(counts, self.device, torch.float64)
        self.lengths[slot] = n
        return PenaltyRow(self, slot, columns)

    def append(self, row: PenaltyRow, token: int) -> None:
        j = row.columns.get(token)
        if j is None:
            assert row.slot is not None
            j = row.columns[token] = self.lengths[row.slot]
            self.lengths[row.slot] += 1
            self._queued.append((row, j, token))
        else:
            self._queued.append((row, j, -1))  # a count only

    def release(self, row: PenaltyRow) -> None:
        if row.slot is not None:
            self._free.append(row.slot)
            row.slot = None

    def flush(self) -> None:
        """Write the queued appends: one copy to the device, one write of the new tokens and one
        scatter of the counts (sizes known on the host: nothing is read back)."""
        queued = [q for q in self._queued if q[0].slot is not None]
        self._queued = []
        if not queued:
            return
        self._fit(max(self.lengths))
        new = [v for row, j, token in queued if token >= 0 for v in (row.slot or 0, j, token)]
        counted = [v for row, j, _ in queued for v in (row.slot or 0, j)]
        packed = to_device([*new, *counted], self.device, torch.long)
        written = packed[: len(new)].view(-1, 3)
        self.tokens[written[:, 0], written[:, 1]] = written[:, 2]
        slots_columns = packed[len(new) :].view(-1, 2)
        ones = torch.ones(len(queued), dtype=torch.float64, device=self.device)
        self.counts.index_put_((slots_columns[:, 0], slots_columns[:, 1]), ones, accumulate=True)

    def gather(
        self,
        rows: Sequence[int],
        kept: Sequence[PenaltyRow],
        repetition: Sequence[float],
        frequency: Sequence[float],
        presence: Sequence[float],
    ) -> TablePenalties:
        """The step's penalties of score rows `rows`, whose kept state is `kept` (rows with at
        least one token: `PenaltyRow.columns` not empty)."""
        self.flush()
        slots = [row.slot for row in kept if row.slot is not None]
        assert len(slots) == len(kept), "a released penalty row was gathered"
        lengths = [self.lengths[s] for s in slots]
        width = max(lengths)
        index = to_device([*rows, *slots, *lengths], self.device, torch.long).view(3, -1)
        slot = index[1].unsqueeze(1)
        column = torch.minimum(torch.arange(width, device=self.device), index[2].unsqueeze(1) - 1)
        f32, f64 = torch.float32, torch.float64
        return TablePenalties(
            rows=index[0],
            tokens=self.tokens[slot, column],
            counts=self.counts[slot, column],
            repetition=to_device(repetition, self.device, f32).unsqueeze(1),
            frequency=to_device(frequency, self.device, f64).unsqueeze(1),
            presence=to_device(presence, self.device, f64).unsqueeze(1),
        )

    def _new_slot(self) -> int:
        self.lengths.append(0)
        slots = len(self.lengths)
        if slots > self.tokens.shape[0]:
            self._grow(max(8, 2 * self.tokens.shape[0]), self.tokens.shape[1])
        return slots - 1

    def _fit(self, width: int) -> None:
        if width > self.tokens.shape[1]:
            self._grow(self.tokens.shape[0], max(64, 2 * self.tokens.shape[1], width))

    def _grow(self, slots: int, width: int) -> None:
        tokens = torch.zeros((slots, width), dtype=torch.long, device=self.device)
        counts = torch.zeros((slots, width), dtype=torch.float64, device=self.device)
        old_slots, old_width = self.tokens.shape
        tokens[:old_slots, :old_width] = self.tokens
        counts[:old_slots, :old_width] = self.counts
        self.tokens, self.counts = tokens, counts
