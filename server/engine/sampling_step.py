"""One call into decoding/ for every row that samples in a step, whatever its strategy.

Per-row parameters become tensors once per step (`SamplingTensors`), constrained rows get their
allowed-token mask (`build_constraint_mask`), the logits are processed (mask, penalties, bans,
warpers) and a token is chosen per row; rows whose request asked for logprobs (beams excepted:
beams.py keeps theirs) get the raw model's logprob of that token and its top alternatives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Rows
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoding import SamplingTensors, sample, token_logprobs
from decoding.constraints import TokenConstraint, build_constraint_mask, rows_without_tokens
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.work import WorkItem


@dataclass
class Choices:
    scores: torch.Tensor  # [R, V] processed log-probs (beam searches step on these)
    tokens: list[int]  # the chosen token of each row (unused by beam rows)
    logprobs: dict[int, TokenLogprob]  # by row, for the rows that asked for logprobs
    no_token: set[int] = field(default_factory=set)  # constrained rows left nothing to choose
    mask_seconds: float | None = None  # time spent building constraint masks (None: no rows)


class ChoosingRow(Protocol):
    """What choosing reads of a row (a `Sequence`, or a position after some of its drafts)."""

    request: EngineRequest
    constraint: TokenConstraint | None

    @property
    def output_ids(self) -> list[int]: ...


def choose(rows: Rows[ChoosingRow], logits: torch.Tensor, eos_ids: frozenset[int]) -> Choices:
    """Process `logits` [R, V] of `rows` and choose each row's next token."""
    params = [s.request.params for s in rows]
    vocab = logits.shape[-1]
    mask, mask_seconds = None, None
    if any(s.constraint is not None for s in rows):
        start = time.perf_counter()
        mask = build_constraint_mask(
            [s.constraint for s in rows],
            [s.request.finishing_ids for s in rows],
            eos_ids,
            vocab,
            logits.device,
        )
        mask_seconds = time.perf_counter() - start
    tensors = SamplingTensors.from_rows(
        params,
        [s.request.prompt_ids for s in rows],
        [s.output_ids for s in rows],
        eos_ids,
        vocab,
        logits.device,
        constraint=mask,
    )
    generators = [s.request.generator for s in rows]
    beam_only = all(p.is_beam for p in params)  # beams take their tokens from their searches
    scores, tokens = sample(logits, tensors, generators, need_tokens=not beam_only)
    wanted = tensors.logprob_rows  # non-beam rows whose request asked for logprobs
    logprobs: dict[int, TokenLogprob] = {}
    if wanted:
        top = max(params[r].logprobs or 0 for r in wanted)
        lp = token_logprobs(logits, [tokens[r] for r in wanted], rows=wanted, num_top=top)
        for r, (chosen, alternatives) in zip(wanted, lp.to_host()):
            logprobs[r] = TokenLogprob(tokens[r], chosen, alternatives[: params[r].logprobs or 0])
    no_token = rows_without_tokens(scores, mask)
    return Choices(scores, tokens, logprobs, no_token, mask_seconds)


def select_items(
    sampling: list[WorkItem[Sequence]], logits: torch.Tensor, kept: list[int]
) -> tuple[list[WorkItem[Sequence]], torch.Tensor]:
    """Items `kept` of the sampling items, and their logits rows (1 + len(draft) each)."""
    if len(kept) == len(sampling):
        return sampling, logits
    starts, rows = [0], list[int]()
    for item in sampling:
        starts.append(starts[-1] + 1 + len(item.draft))
    for i in kept:
        rows.extend(range(starts[i], starts[i + 1]))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return [sampling[i] for i in kept], logits.index_select(0, index)


def without_retired(
    sampling: list[WorkItem[Sequence]], logits: torch.Tensor
) -> tuple[list[WorkItem[Sequence]], torch.Tensor]:
    """The items (and their logits) whose rows are still in the batch: with overlapped outputs
    a stop string may end a row after its step was queued; that step's tokens are dropped."""
    return select_items(
        sampling, logits, [i for i, item in enumerate(sampling) if not item.seq.retired]
    )
