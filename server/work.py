"""The contract between scheduling and the model side: one row's share of a step.

The scheduler produces `WorkItem`s, the model runner consumes them; neither imports the other. A row
is anything with the three attributes of `Row` (the engine's `Sequence` is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from decoding.logprobs import TokenLogprobs

NO_ADAPTER = -1  # a row's LoRA slot when it runs the base model


class Row(Protocol):
    """What the model runner reads of a row: its tokens, how many are cached, where they live,
    which adapter it uses."""

    token_ids: list[int]
    num_computed: int  # tokens whose keys/values are in the cache
    block_table: list[int]

    @property
    def lora_slot(self) -> int:
        """The LoRA adapter slot its tokens use; -1: the base model (read only with adapters)."""
        ...


RowT = TypeVar("RowT", bound=Row)


@dataclass(frozen=True)
class ScoreSpan:
    """Positions [start, stop) of a row whose following token is scored (prompt logprobs): its
    log-probability, its rank and the `num_top` likeliest alternatives at each position."""

    start: int
    stop: int
    num_top: int


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 3x more, once per row per step
class WorkItem(Generic[RowT]):
    """One row's share of a step: `num_new` tokens starting at its `num_computed`; `score` asks
    for the logprobs of the tokens that follow some of them (inside this chunk). A decoding row
    may add speculative `draft` tokens after its own (counted in `num_new`): the step then
    returns logits at its last token and at every draft."""

    seq: RowT
    num_new: int
    score: ScoreSpan | None = None
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the row, so its last token predicts the next."""
        return self.seq.num_computed + self.num_new == len(self.seq.token_ids) + len(self.draft)


@dataclass(frozen=True)
class DeferredTokens:
    """Input tokens a step reads from the device (async scheduling): the first new token of
    item `items[j]` is `values[sources[j]]`, the token the previous step chose for that row and
    has not read back yet; the row holds a placeholder in its place until then."""

    values: torch.Tensor  # [P] long, on the model's device
    items: list[int]
    sources: list[int]


@dataclass
class StepOutput:
    """What a step returns: logits [R, V] of the items that sample (in order, 1 + len(draft) rows
    each: its last token and its drafts), and the scored positions of the items that asked
    (`WorkItem.score`), by item index."""

    logits: torch.Tensor
    scores: dict[int, TokenLogprobs] = field(default_factory=dict)
    reused: bool = False  # the logits live in a buffer the next step overwrites (a CUDA graph's)
