"""Pure decoding algorithms over batched logits: no HTTP, no scheduler. See decoding/README.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoding.beam_search import BeamSearch, BeamStep, Hypothesis, step_beam_searches
from decoding.group_beam import GroupBeamSearch
from decoding.logprobs import TokenLogprobs, token_logprobs
from decoding.param_checks import DecodingParamsError
from decoding.params import DecodingParams, check_vocab, ranked_tokens, request_width
from decoding.ranking import rank_samples
from decoding.sampling import SamplingTensors, choose_tokens, process_logits, sample


def make_beam_search(
    params: DecodingParams,
    eos_ids: Sequence[int] | frozenset[int],
    *,
    max_new_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> BeamSearch | GroupBeamSearch:
    """The state machine for a beam request: GroupBeamSearch or BeamSearch by `params.strategy`."""
    search = GroupBeamSearch if params.strategy == "group_beam" else BeamSearch
    return search(params, eos_ids, max_new_tokens=max_new_tokens, generator=generator)


__all__ = [
    "BeamSearch",
    "BeamStep",
    "DecodingParams",
    "DecodingParamsError",
    "GroupBeamSearch",
    "Hypothesis",
    "SamplingTensors",
    "TokenLogprobs",
    "check_vocab",
    "choose_tokens",
    "make_beam_search",
    "process_logits",
    "sample",
    "rank_samples",
    "ranked_tokens",
    "request_width",
    "step_beam_searches",
    "token_logprobs",
]
