"""Sample-and-rank (best_of): draw `best_of` samples as ordinary sampled rows, return the best `n`.

"Best" is the highest cumulative log-probability under the raw model (Meena, Adiwardana et al.
2020; vLLM's best_of). Accumulate each sample's chosen-token logprob from `token_logprobs` on the
raw logits while it runs. `length_penalty` > 0 divides by length**length_penalty first; 1.0 gives
the per-token average that OpenAI's legacy `best_of` documentation describes. Default 0: the sum.
"""

from __future__ import annotations

from collections.abc import Sequence


def rank_samples(
    cumulative_logprobs: Sequence[float],
    n: int,
    lengths: Sequence[int] | None = None,
    length_penalty: float = 0.0,
) -> list[int]:
    """Indices of the `n` best samples, best first; ties keep sample order."""
    if lengths is None or length_penalty == 0.0:
        keys = list(cumulative_logprobs)
    else:
        keys = [
            lp / max(1, length) ** length_penalty
            for lp, length in zip(cumulative_logprobs, lengths)
        ]
    order = sorted(range(len(keys)), key=lambda i: -keys[i])
    return order[:n]
