"""Beam search and beam sampling as a per-request state machine the engine drives step by step.

Semantics are Hugging Face v4's `BeamSearchScorer` / `BeamHypotheses` (see beam_scorer.py).
Beam sampling follows v4's `_beam_sample` after the 4.4x fix: warpers act on each step's
processed log-probs (`process_logits` does that), then K candidates are drawn without
replacement from softmax(log-prob + running score) over all beams and sorted by score.

Engine contract: the request starts as ONE row (its prefilled prompt); `step()` takes the
processed scores of the rows it asked for (1 row first, then one per beam returned, in that
order) and answers, for each new beam, the row it continues (`parents`) and its new token.
The engine forks KV blocks from the parent (shared prefix, copy-on-write). When `done`, run no
more rows and call `finalize()` (that step's beams are still listed: at the length limit they
join the result). `finalize()` may also be called early (context full, abort).

Deviation kept on purpose: HF seeds beams 1..W-1 with score -1e9 copies of the prompt; we start
from one row and simply never continue -inf candidates, so a request whose processors leave fewer
than W finite candidates runs fewer rows (HF would carry -1e9 beams or fail to sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch

from decoding.beam_scorer import (
    BeamGroup,
    BeamStep,
    Candidates,
    Hypothesis,
    best_hypotheses,
    host_pair,
)
from decoding.params import DecodingParams
from decoding.top_k import largest
from decoding.transfer import to_device


class RequestSearch:
    """What the searches of one beam request share: its params and one `BeamGroup` per group,
    each limited to `max_new_tokens` (the room left in the context) and `params.max_tokens`."""

    strategies: tuple[str, ...] = ()

    def __init__(
        self,
        params: DecodingParams,
        eos_ids: Sequence[int] | frozenset[int],
        *,
        max_new_tokens: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if params.strategy not in self.strategies:
            runs = " or ".join(self.strategies)
            raise ValueError(f"{type(self).__name__} runs {runs}, got {params.strategy!r}")
        self.params = params
        self.generator = generator  # None + a seed: made on the scores' device at the first step
        limit = (
            params.max_tokens if max_new_tokens is None else min(max_new_tokens, params.max_tokens)
        )
        finishing = params.finishing_ids(eos_ids)
        size = params.num_beams // params.num_beam_groups
        self.groups = [
            BeamGroup(
                size, finishing, params.length_penalty, params.early_stopping, max(1, limit), g
            )
            for g in range(params.num_beam_groups)
        ]


class BeamSearch(RequestSearch):
    """Beam search ("beam") or beam sampling ("beam_sample") for one request."""

    strategies = ("beam", "beam_sample")

    @property
    def group(self) -> BeamGroup:
        return self.groups[0]

    @property
    def sampling(self) -> bool:
        return self.params.strategy == "beam_sample"

    @property
    def done(self) -> bool:
        return not self.group.active

    @property
    def num_rows(self) -> int:
        """Rows the next `step()` expects (0 when done)."""
        return 0 if self.done else len(self.group.beam_tokens)

    def step(self, scores: torch.Tensor) -> BeamStep:
        """Advance with the processed scores [num_rows, V] of this request's rows."""
        self.check_rows(scores)
        vocab = scores.shape[-1]
        flat = self.group.accumulate(scores)
        if self.sampling:
            if self.generator is None and self.params.seed is not None:
                self.generator = torch.Generator(device=flat.device).manual_seed(self.params.seed)
            cand = self.group.sample_candidates(flat, vocab, self.generator, self.params.num_beams)
        else:
            cand = self.group.top_candidates(flat, vocab)
        return self.apply(cand)

    def check_rows(self, scores: torch.Tensor) -> None:
        if self.done:
            raise RuntimeError("beam search is done; call finalize()")
        if scores.shape[0] != self.num_rows:
            raise ValueError(f"expected {self.num_rows} rows of scores, got {scores.shape[0]}")

    def apply(self, cand: Candidates) -> BeamStep:
        """Second half of `step()` (exposed so `step_beam_searches` can batch the top-k)."""
        parents, tokens, finished = self.group.advance(cand)
        return BeamStep(parents, tokens, self.done, finished)

    def finalize(self) -> list[Hypothesis]:
        """The `n` best hypotheses, best first. Ends the search."""
        self.group.close()
        return best_hypotheses([self.group], self.params.n)


class SupportsStep(Protocol):
    def step(self, scores: torch.Tensor) -> BeamStep: ...


def step_beam_searches(
    searches: Sequence[SupportsStep], scores: Sequence[torch.Tensor]
) -> list[BeamStep]:
    """`[s.step(x) for s, x in zip(searches, scores)]`, with one top-k (and one host sync) for
    every set of deterministic `BeamSearch`es with the same number of rows and candidates.
    Beam sampling and group beam searches are stepped one by one."""
    results: list[BeamStep | None] = [None] * len(searches)
    buckets: dict[tuple[int, int, int], list[int]] = {}
    for i, (s, x) in enumerate(zip(searches, scores)):
        if not isinstance(s, BeamSearch) or s.sampling:
            results[i] = s.step(x)
        else:
            s.check_rows(x)
            buckets.setdefault((x.shape[0], x.shape[1], s.group.num_candidates), []).append(i)
    for (rows, vocab, k), members in buckets.items():
        batch = [cast(BeamSearch, searches[i]) for i in members]
        flat = accumulated([b.group for b in batch], [scores[i] for i in members])
        values, index = largest(flat, min(k, rows * vocab))
        values_l, index_l = host_pair(values, index)
        for j, (b, i) in enumerate(zip(batch, members)):
            cand = Candidates(
                values_l[j], [x // vocab for x in index_l[j]], [x % vocab for x in index_l[j]]
            )
            results[i] = b.apply(cand)
    return [r for r in results if r is not None]


def accumulated(groups: Sequence[BeamGroup], scores: Sequence[torch.Tensor]) -> torch.Tensor:
    """[searches, rows * V]: each group's `accumulate(scores)`, stacked. Where the scores are
    rows that lie back to back in one tensor (the engine hands each request's rows of one
    step's scores, adjacent), that is one add over the block with every running score, not an
    add per search and a copy of them all."""
    block = adjacent_rows(scores)
    if block is None:
        return torch.stack([g.accumulate(x) for g, x in zip(groups, scores)])
    running = to_device(torch.cat([g.beam_scores for g in groups]), block.device)
    return (block.float() + running.unsqueeze(1)).view(len(groups), -1)


def adjacent_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one [rows, V] tensor whose consecutive row ranges `parts` are (None where they are
    not: another layout, or a gap between two of them)."""
    first = parts[0]
    if first.dim() != 2 or not first.is_contiguous():
        return None
    width, size = first.shape[1], first.element_size()
    at = first.data_ptr()
    for part in parts:
        same = part.dim() == 2 and part.shape[1] == width and part.dtype == first.dtype
        if not (same and part.is_contiguous() and part.data_ptr() == at):
            return None
        if part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        at += part.numel() * size
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, width), (width, 1))
