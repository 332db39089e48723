"""What a step's sampling tensors take from the rows' params alone, kept between steps.

In the steady state the same requests' rows sample step after step: their warper values, logit
bias entries and row lists (beams, drawn rows, rows that asked for logprobs) are built once and
reused (`KeptRowTensors`). When a request joins or leaves the step they are built again from each
request's `RowRecord`, worked out once while the request runs, not from every row's params.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from decoding.params import BEAM_STRATEGIES, DecodingParams
from decoding.processors import Pairs, logit_bias_pairs
from decoding.transfer import to_device
from decoding.warpers import WarperTensors, WarperValues, warper_tensors, warper_values


@dataclass(slots=True, eq=False)  # compared by identity: `None in rows` stays fast
class RowRecord:
    """What one request's params give each of its rows, worked out once per request (a step that
    rebuilds its `RowTensors` reads these, not every row's params again)."""

    beam: bool  # normalised to log-probs (beam strategies; a fused row's are log-probs already)
    drawn: bool  # draws a token at random (sample, best_of)
    min_keep: int  # HF's min_tokens_to_keep for the warpers
    logprobs: bool  # a non-beam row that asked for logprobs or rank samples (best_of)
    warpers: WarperValues | None  # None: no warper acts on the row
    params: DecodingParams  # held, so that its id stays its own while the record is kept

    @classmethod
    def of(
        cls, p: DecodingParams, eos_ids: Sequence[int] | frozenset[int], vocab_size: int
    ) -> RowRecord:
        s = p.strategy
        drawn = s in ("sample", "best_of")
        min_keep = len(p.finishing_ids(eos_ids)) + 1 if s == "beam_sample" else 1
        return cls(
            beam=s in BEAM_STRATEGIES and p.lm_fusion is None,
            drawn=drawn,
            min_keep=min_keep,
            logprobs=s not in BEAM_STRATEGIES and (p.logprobs is not None or s == "best_of"),
            warpers=warper_values(p, min_keep, vocab_size) if drawn or s == "beam_sample" else None,
            params=p,
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
            logit_bias=logit_bias_pairs(
                [rec.params.logit_bias for rec in records], vocab_size, device
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
