"""Two models' scores combined per step: shallow LM fusion and contrastive decoding.

fairseq's `SequenceGenerator` fuses a language model into every step of beam search as
`log_softmax(main) + lm_weight * log_softmax(lm)`; beam scores then accumulate those fused
scores, unnormalised. A negative weight with a plausibility threshold is contrastive decoding
(Li et al., 2023): an expert's log-probs minus an amateur's, among the tokens to which the expert
gives at least `plausibility` times its best token's probability (the others are banned).

The fused scores replace a row's logits before anything else reads them, so every strategy
(greedy, sampling and its warpers, every beam search, constrained rows) chooses from them. They
are log-probabilities already (the main model's part is normalised): beam rows take them as they
are, and the other rows' `log_softmax` of them is the fused distribution they draw from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decoding.param_checks import DecodingParamsError


@dataclass(frozen=True)
class LMFusion:
    """A request's companion model (`model`, a served extra model's name), its `weight`, and the
    plausibility threshold (0: none) below which a token is banned by the main model alone."""

    model: str
    weight: float
    plausibility: float = 0.0

    def __post_init__(self) -> None:
        if not self.model:
            raise DecodingParamsError("lm_fusion.model", "must name a served extra model")
        if not math.isfinite(self.weight):
            raise DecodingParamsError("lm_fusion.weight", "must be a finite number")
        if not 0.0 <= self.plausibility < 1.0:
            raise DecodingParamsError(
                "lm_fusion.plausibility", "must be in [0, 1) (0: every token is plausible)"
            )


def fuse_logits_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    companion: torch.Tensor,
    weights: torch.Tensor,
    plausibility: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `rows` [F] of the float32 `logits` [R, V] replaced, in place, by `log_softmax(logits)
    + weights * log_softmax(companion)` (`companion` [F, V], `weights` [F, 1]); where
    `plausibility` [F, 1] is given, tokens whose main-model probability is below it times the
    row's best are -inf. Returns `logits`."""
    main = logits.index_select(0, rows).log_softmax(dim=-1)
    scores = main.clone() if plausibility is not None else main
    scores.addcmul_(weights, companion.float().log_softmax(dim=-1))
    if plausibility is not None:
        floor = main.max(dim=-1, keepdim=True).values + plausibility.log()  # log(0): no floor
        scores.masked_fill_(main < floor, float("-inf"))
    return logits.index_copy_(0, rows, scores)
