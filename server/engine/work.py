"""The scheduler's unit of work: one row's share of a step, on the engine's side.

The scheduler plans `WorkItem`s over live rows (`Sequence`s); the engine turns a step's items into
the plain `StepPlan` the model side reads (plan_builder.py), so nothing past that point sees a
row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from server.engine.block_pool import BlockPool
    from server.engine.request import Sequence


@dataclass(frozen=True)
class ScoreSpan:
    """Positions [start, stop) of a row whose following token is scored (prompt logprobs): its
    log-probability, its rank and the `num_top` likeliest alternatives at each position."""

    start: int
    stop: int
    num_top: int


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 3x more, once per row per step
class WorkItem:
    """One row's share of a step: `num_new` tokens starting at its `num_computed`; `score` asks
    for the logprobs of the tokens that follow some of them (inside this chunk). A decoding row
    may add speculative `draft` tokens after its own (counted in `num_new`): the step then
    returns logits at its last token and at every draft."""

    seq: Sequence
    num_new: int
    score: ScoreSpan | None = None
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the row, so its last token predicts the next."""
        return self.seq.num_computed + self.num_new == len(self.seq.token_ids) + len(self.draft)


class Drafter(Protocol):
    """Speculation's proposer (speculation.py: n-gram lookup; draft_model.py: a draft model)."""

    def add(
        self, items: list[WorkItem], budget: int, pool: BlockPool, copies: list[tuple[int, int]]
    ) -> None:
        """Give the step's decoding `items` drafts (`WorkItem.draft`, counted in `num_new`), at
        most `budget` tokens in all, in blocks grown from `pool`'s free ones; `copies`: the
        step's copy-on-write block copies, not made yet."""
