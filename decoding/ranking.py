"""Sample-and-rank (best_of): draw `best_of` samples as ordinary sampled rows, return the best `n`.

"Best" is the highest cumulative log-probability under the raw model (Meena, Adiwardana et al.
2020; vLLM's best_of): the plain sum of each sample's chosen-token logprobs (`token_logprobs` on
the raw logits), accumulated while it runs. No length normalisation (a request's
`length_penalty` applies to beam search only): every token adds a negative logprob, so of two
equally likely continuations per token the shorter sample ranks first.
"""

from __future__ import annotations

from collections.abc import Sequence


def rank_samples(cumulative_logprobs: Sequence[float], n: int) -> list[int]:
    """Indices of the `n` best samples, best first; ties keep sample order."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])
    return order[:n]
