"""One decode step's per-row tensors, the processing pipeline, and the choice of next tokens.

Every row carries its own parameters as tensors, so one call serves a batch that mixes greedy,
sampled and beam rows of many requests. The engine drives it as:

    t = SamplingTensors.from_rows(params, prompt_ids, output_ids, eos_ids, vocab_size, device)
    scores = process_logits(logits, t)           # processors, then warpers on sampling rows
    tokens = choose_tokens(scores, t, u)         # argmax / draw; beam rows: see beam_search.py

Beam rows (strategy beam, group_beam, beam_sample) come out of `process_logits` as processed
*log-probabilities*: HF applies processors to `log_softmax(logits)` in beam search but to raw
logits when sampling or greedy, and the two differ (the repetition penalty scales by sign).

Sampling is by inverse CDF: one uniform number per row, located in the row's cumulative
probabilities (no host sync). The exponential race (argmax p / Exp(1), what `torch.multinomial`
does) needs V random numbers per row: with a 262k vocabulary that was 14 ms per row on CPU, 7x
the cost of softmax + cumsum. A row's number comes from its random stream (`RandomStreams`,
random_streams.py: a key and a counter per row, all rows' numbers in a few tensor ops), so a
seeded request gets the same tokens whatever else is in the batch; without streams the numbers
come from torch's global generator. Seeded tokens therefore differ from HF's (which uses
`torch.multinomial` on the global RNG); the distribution is the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.constraints import ConstraintMask, apply_constraint_mask_
from decoding.params import DecodingParams
from decoding.penalty_table import PenaltyRow
from decoding.processors import (
    ProcessorTensors,
    TokenIds,
    apply_processors_,
    build_processor_tensors,
)
from decoding.random_streams import RandomStreams
from decoding.row_tensors import KeptRowTensors, RowTensors
from decoding.warpers import WarperTensors, apply_warpers_


@dataclass
class SamplingTensors:
    num_rows: int
    processors: ProcessorTensors
    warpers: WarperTensors | None
    beam_rows: torch.Tensor | None  # [B] long: beam rows log_softmax normalises (None: none; a
    # fused row is a beam row whose scores are log-probs already: decoding/fusion.py)
    sample_rows: torch.Tensor | None  # [S] long: rows that draw a token at random
    sample_row_list: list[int]
    logprob_rows: list[int]  # non-beam rows that asked for logprobs or rank samples (best_of);
    # beam rows get theirs from BeamStep (parents, tokens) and (finished) pairs
    constraint: ConstraintMask | None = None  # allowed tokens of the constrained rows

    @property
    def all_greedy(self) -> bool:
        return self.sample_rows is None

    @classmethod
    def from_rows(
        cls,
        params: Sequence[DecodingParams],
        prompt_ids: Sequence[TokenIds],
        output_ids: Sequence[TokenIds],
        eos_ids: Sequence[int] | frozenset[int],
        vocab_size: int,
        device: torch.device | str,
        constraint: ConstraintMask | None = None,
        penalty_rows: Sequence[PenaltyRow | None] | None = None,
        kept: KeptRowTensors | None = None,
    ) -> SamplingTensors:
        """Tensors for R rows: each row's params, its prompt and the tokens it generated so far.

        A request with width W > 1 contributes W rows (its n samples or its beams, in order), each
        with its own `output_ids`. `eos_ids` are the model's EOS ids (the request's
        `stop_token_ids` and `ignore_eos` are applied per row). `constraint`: the mask of
        the constrained rows (`build_constraint_mask`, constraints.py), if any.
        `penalty_rows`: the rows' kept penalty state, where they have one (penalty_table.py).
        `kept`: the tensors that depend on the rows' params alone, kept from the last step
        and reused while the rows' params are the same objects in the same order.
        """
        processors = build_processor_tensors(
            params,
            prompt_ids,
            output_ids,
            eos_ids,
            vocab_size,
            device,
            penalty_rows,
            with_bias=False,  # the kept row tensors hold it (params alone decide it)
        )
        by_params = (
            kept.tensors(params, eos_ids, vocab_size, device)
            if kept is not None
            else RowTensors.of(params, eos_ids, vocab_size, device)
        )
        warpers = by_params.warpers
        processors.logit_bias = by_params.logit_bias
        return cls(
            num_rows=len(params),
            processors=processors,
            # a step's own copy: its warpers set `unsure`, which a late read may still need
            warpers=dataclasses.replace(warpers) if warpers is not None else None,
            beam_rows=by_params.beam_rows,
            sample_rows=by_params.sample_rows,
            sample_row_list=by_params.sample_row_list,
            logprob_rows=by_params.logprob_rows,
            constraint=constraint,
        )


def process_logits(logits: torch.Tensor, t: SamplingTensors, exact: bool = True) -> torch.Tensor:
    """Processed float32 scores [R, V]; `logits` is left untouched (logprobs read it raw).

    A batch with nothing to process (plain greedy / temperature-1 rows) costs no copy at all.
    `exact` False reads nothing back from the device (see `apply_warpers_`; `sample` uses it).
    """
    scores = logits.float()
    if t.beam_rows is None and t.processors.empty and t.warpers is None and t.constraint is None:
        return scores
    beams_only = t.beam_rows is not None and len(t.beam_rows) == len(scores)
    if beams_only:  # one new tensor, no copy first
        scores = scores.log_softmax(dim=-1)
    elif scores.data_ptr() == logits.data_ptr():
        scores = scores.clone()  # every step below works in place on our own copy
    if t.beam_rows is not None and not beams_only:
        scores[t.beam_rows] = scores[t.beam_rows].log_softmax(dim=-1)
    if t.constraint is not None:  # HF: the prefix-constrained mask, after log_softmax for beams
        apply_constraint_mask_(scores, t.constraint)
    apply_processors_(scores, t.processors)
    return apply_warpers_(scores, t.warpers, exact)


def sample_uniforms(
    count: int, streams: RandomStreams | None, device: torch.device
) -> torch.Tensor:
    """[count, 1] U[0, 1) for the sampling rows: from their `streams`, else the global RNG."""
    if streams is not None:
        return streams.draw()
    return torch.rand((count, 1), device=device)


def choose_tokens(
    scores: torch.Tensor,
    t: SamplingTensors,
    streams: RandomStreams | None = None,
    u: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of processed `scores` [R, V]: argmax, or a draw on sampling rows.

    `streams`: the sampling rows' random streams (None: the global RNG); `u`: their uniform
    numbers, if already drawn. Beam rows get their argmax, which the engine ignores: their tokens
    come from the request's BeamSearch. Returns [R] long.
    """
    tokens = scores.argmax(dim=-1)
    if t.sample_rows is None:
        return tokens
    cdf = scores[t.sample_rows].softmax(dim=-1, dtype=torch.float32).cumsum(dim=-1)
    if u is None:
        u = sample_uniforms(len(t.sample_row_list), streams, cdf.device)
    # First index whose cumulative mass exceeds u * total: never a zero-probability token.
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    tokens[t.sample_rows] = drawn.clamp_(max=scores.shape[-1] - 1)  # a fully banned row: no crash
    return tokens


@dataclass
class Draw:
    """A step's choice, still on the device: processed `scores`, the chosen `tokens` (None when
    only beam rows chose), the uniform draws `u` of the sampling rows, and `unsure`, the flag of
    a warper that could not be sure without reading back (ties at top-k's k-th value; rare)."""

    scores: torch.Tensor
    tokens: torch.Tensor | None
    u: torch.Tensor | None
    unsure: torch.Tensor | None


def draw(
    logits: torch.Tensor,
    t: SamplingTensors,
    streams: RandomStreams | None = None,
    need_tokens: bool = True,
) -> Draw:
    """`process_logits` + `choose_tokens` without reading anything back; `settle` reads it.
    `streams`: the sampling rows' random streams, in `t.sample_row_list` order."""
    scores = process_logits(logits, t, exact=False)
    u = None
    if t.sample_rows is not None:
        u = sample_uniforms(len(t.sample_row_list), streams, logits.device)
    unsure = t.warpers.unsure if t.warpers is not None else None
    if not need_tokens and unsure is None:
        return Draw(scores, None, u, None)
    return Draw(scores, choose_tokens(scores, t, u=u), u, unsure)


def settle(
    d: Draw, values: list[int], logits: torch.Tensor, t: SamplingTensors
) -> tuple[torch.Tensor, list[int]]:
    """The exact scores and tokens of a draw whose `values` (its tokens, then its `unsure` flag
    when it has one) were read back: a flagged step is processed again exactly, with the same
    random numbers, so the result is always `choose_tokens(process_logits(logits, t), t, u=u)`'s."""
    if d.unsure is None or not values.pop():
        return d.scores, values
    scores = process_logits(logits, t, exact=True)
    return scores, choose_tokens(scores, t, u=d.u).tolist()


def draw_values(d: Draw) -> torch.Tensor | None:
    """What `settle` needs read back, as one long tensor (None: nothing)."""
    if d.tokens is None:
        return None
    if d.unsure is None:
        return d.tokens
    return torch.cat([d.tokens, d.unsure.view(1).to(d.tokens.dtype)])


def sample(
    logits: torch.Tensor,
    t: SamplingTensors,
    streams: RandomStreams | None = None,
    need_tokens: bool = True,
) -> tuple[torch.Tensor, list[int]]:
    """`draw` + `settle` with one device-to-host copy per step: the tokens, and with them the
    flag of a warper that could not be sure without reading back."""
    d = draw(logits, t, streams, need_tokens)
    values = draw_values(d)
    if values is None:
        return d.scores, []
    return settle(d, values.tolist(), logits, t)
