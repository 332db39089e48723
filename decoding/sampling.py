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
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from decoding.constraints import ConstraintMask, apply_constraint_mask_
from decoding.params import BEAM_STRATEGIES, DecodingParams
from decoding.penalty_table import PenaltyRow
from decoding.processors import (
    Pairs,
    ProcessorTensors,
    TokenIds,
    apply_processors_,
    build_processor_tensors,
    logit_bias_pairs,
)
from decoding.random_streams import RandomStreams
from decoding.transfer import to_device
from decoding.warpers import (
    WarperTensors,
    WarperValues,
    apply_warpers_,
    warper_tensors,
    warper_values,
)


@dataclass
class SamplingTensors:
    num_rows: int
    processors: ProcessorTensors
    warpers: WarperTensors | None
    beam_rows: torch.Tensor | None  # [B] long: rows scored as log-probs, None if there are none
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
            params, prompt_ids, output_ids, eos_ids, vocab_size, device, penalty_rows, False
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


@dataclass(slots=True, eq=False)  # compared by identity: `None in rows` stays fast
class RowRecord:
    """What one request's params give each of its rows, worked out once per request (a step that
    rebuilds its `RowTensors` reads these, not every row's params again)."""

    beam: bool  # scored as log-probs (beam strategies)
    drawn: bool  # draws a token at random (sample, best_of)
    min_keep: int  # HF's min_tokens_to_keep for the warpers
    logprobs: bool  # a non-beam row that asked for logprobs or rank samples (best_of)
    warpers: WarperValues | None  # None: no warper acts on the row
    params: DecodingParams  # held, so that its id stays its own while the record is kept
    logit_bias: Mapping[int, float] | None = None  # None: no bias

    @classmethod
    def of(
        cls, p: DecodingParams, eos_ids: Sequence[int] | frozenset[int], vocab_size: int
    ) -> RowRecord:
        s = p.strategy
        drawn = s in ("sample", "best_of")
        min_keep = len(p.finishing_ids(eos_ids)) + 1 if s == "beam_sample" else 1
        return cls(
            beam=s in BEAM_STRATEGIES,
            drawn=drawn,
            min_keep=min_keep,
            logprobs=s not in BEAM_STRATEGIES and (p.logprobs is not None or s == "best_of"),
            warpers=warper_values(p, min_keep, vocab_size) if drawn or s == "beam_sample" else None,
            params=p,
            logit_bias=p.logit_bias or None,
        )


@dataclass
class RowTensors:
    """What a step's sampling tensors take from the rows' params alone: the warpers' per-row
    values, the logit bias entries, and which rows are scored as beams, drawn, or asked for
    logprobs."""

    warpers: WarperTensors | None
    beam_rows: torch.Tensor | None
    sample_rows: torch.Tensor | None
    sample_row_list: list[int]
    logprob_rows: list[int]
    logit_bias: Pairs | None = None

    @classmethod
    def of(
        cls,
        params: Sequence[DecodingParams],
        eos_ids: Sequence[int] | frozenset[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> RowTensors:
        records = [RowRecord.of(p, eos_ids, vocab_size) for p in params]
        return cls.of_records(records, vocab_size, device)

    @classmethod
    def of_records(
        cls, records: Sequence[RowRecord], vocab_size: int, device: torch.device | str
    ) -> RowTensors:
        sample_list = [r for r, rec in enumerate(records) if rec.drawn]
        beam_list = [r for r, rec in enumerate(records) if rec.beam]
        return cls(
            warpers=warper_tensors(
                [rec.warpers for rec in records], [rec.min_keep for rec in records], device
            ),
            beam_rows=to_device(beam_list, device, torch.long) if beam_list else None,
            sample_rows=to_device(sample_list, device, torch.long) if sample_list else None,
            sample_row_list=sample_list,
            logprob_rows=[r for r, rec in enumerate(records) if rec.logprobs],
            logit_bias=(
                logit_bias_pairs([rec.logit_bias for rec in records], vocab_size, device)
                if any(rec.logit_bias for rec in records)
                else None
            ),
        )


class KeptRowTensors:
    """The last step's `RowTensors`, kept for the next: in the steady state the same requests'
    rows sample step after step, and their warper values and row lists are built once, not from
    every row's params at every step. When the rows change (a request joins or leaves), the new
    tensors are built from each request's `RowRecord`, worked out once while the request runs.
    Params are compared by identity (a request's `DecodingParams` is one frozen object for all
    its rows), and the kept list and records hold them, so an id cannot be reused by another
    request while it is kept."""

    def __init__(self) -> None:
        self._params: list[DecodingParams] = []
        self._context: tuple[object, ...] = ()
        self._tensors: RowTensors | None = None
        self._records: dict[int, RowRecord] = {}  # by id(params); a record holds its params
        self.hits = 0  # steps that reused the kept tensors

    def tensors(
        self,
        params: Sequence[DecodingParams],
        eos_ids: Sequence[int] | frozenset[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> RowTensors:
        """The kept tensors when `params` (and the EOS ids, vocabulary and device) are the last
        step's, else new ones, kept for the next step."""
        kept = self._params
        context = (eos_ids, vocab_size, str(device))
        if (
            self._tensors is not None
            and len(kept) == len(params)
            and self._context == context
            and all(map(operator.is_, kept, params))
        ):
            self.hits += 1
            return self._tensors
        if self._context != context:
            self._records = {}
        records = self._records
        found = list(map(records.get, map(id, params)))  # one C loop: most rows' are there
        if None in found:
            for r, p in enumerate(params):
                if found[r] is None:
                    found[r] = records[id(p)] = records.get(id(p)) or RowRecord.of(
                        p, eos_ids, vocab_size
                    )
        rows = cast("list[RowRecord]", found)
        if len(records) > 2 * len(params) + 64:  # finished requests' records go, now and then
            self._records = {id(rec.params): rec for rec in rows}
        self._params, self._context = list(params), context
        self._tensors = RowTensors.of_records(rows, vocab_size, device)
        return self._tensors


def process_logits(logits: torch.Tensor, t: SamplingTensors, exact: bool = True) -> torch.Tensor:
    """Processed float32 scores [R, V]; `logits` is left untouched (logprobs read it raw).

    A batch with nothing to process (plain greedy / temperature-1 rows) costs no copy at all.
    `exact` False reads nothing back from the device (see `apply_warpers_`; `sample` uses it).
    """
    scores = logits.float()
    if t.beam_rows is None and t.processors.empty and t.warpers is None and t.constraint is None:
        return scores
    if scores.data_ptr() == logits.data_ptr():
        scores = scores.clone()  # every step below works in place on our own copy
    if t.beam_rows is not None:
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
