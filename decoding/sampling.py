"""Per-row greedy / temperature / top-k / top-p choice of the next token, vectorised over rows.

Every row carries its own parameters as tensors, so one call serves a batch that mixes requests.
Sampling uses the exponential-race trick (argmax of p / Exp(1) noise): it is a draw from the
categorical distribution that needs no host sync, and a request with a seed draws its noise from
its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.params import DecodingParams


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [R] float, 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [R] long, vocab size where disabled
    top_p: torch.Tensor  # [R] float
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_params(
        cls, params: Sequence[DecodingParams], vocab_size: int, device: torch.device | str
    ) -> SamplingTensors:
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device
            ),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
        )


def apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
    if not (t.any_top_k or t.any_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= t.top_k.unsqueeze(1)
    if t.any_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep a token while the mass of the better tokens is below top_p (the top one always stays).
        drop |= mass_before >= t.top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_noise(
    shape: tuple[int, int], generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise; rows with a generator draw from it, the rest from the global RNG."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample_next_tokens(
    logits: torch.Tensor,
    t: SamplingTensors,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of `logits` [R, V] (already processed); returns [R] long."""
    greedy_tokens = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_tokens
    scaled = logits / t.temperature.unsqueeze(1)
    probs = apply_top_k_top_p(scaled, t).softmax(dim=-1, dtype=torch.float32)
    noise = exponential_noise(tuple(probs.shape), generators, probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(t.greedy, greedy_tokens, sampled)
