"""Log-probabilities returned to clients: the chosen token's and the top-K alternatives.

Which distribution: the **raw model distribution**, `log_softmax` of the unprocessed logits at
temperature 1, as OpenAI documents and vLLM returns by default (`logprobs_mode="raw_logprobs"`):
a client can compare them across requests whatever their penalties or temperature. Pass the
processed scores instead if you ever want the sampled distribution; nothing here assumes which.

Beam hypothesis scores are a different thing: like HF they accumulate the *processed* log-probs
(after penalties and bans, and warpers for beam sampling); see beam_search.py. Sample-and-rank
(best_of) ranks on the raw cumulative log-probability of each sample, i.e. the model's likelihood
(Meena), computed with this function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.transfer import to_device


@dataclass
class TokenLogprobs:
    chosen: torch.Tensor  # [N] float: logprob of each (row, token) pair
    top_ids: torch.Tensor  # [N, K] long, best first
    top_logprobs: torch.Tensor  # [N, K] float
    ranks: torch.Tensor | None = None  # [N] long: 1 + how many tokens are likelier, when asked

    @staticmethod
    def cat(parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        """The pairs of several results, in order (all computed with or all without ranks)."""
        ranks = [p.ranks for p in parts]
        return TokenLogprobs(
            chosen=torch.cat([p.chosen for p in parts]),
            top_ids=torch.cat([p.top_ids for p in parts]),
            top_logprobs=torch.cat([p.top_logprobs for p in parts]),
            ranks=None if any(r is None for r in ranks) else torch.cat(ranks),  # type: ignore[arg-type]
        )

    def row(self, i: int, k: int | None = None) -> tuple[float, list[tuple[int, float]]]:
        """Python values of pair i: (chosen logprob, its first k (token, logprob) alternatives)."""
        chosen, alternatives = self.to_host()[i]
        return chosen, alternatives[:k]

    def to_host(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Every pair's (chosen logprob, (token, logprob) alternatives) in one device read: on a
        GPU each read waits for the device, and a 16-beam step has 16+ pairs."""
        return self.unpack(self.packed().tolist())

    def packed(self) -> torch.Tensor:
        """Every pair as one float64 row [chosen, K logprobs, K ids], for a single read (token ids
        are exact in float64 for any vocabulary below 2^53)."""
        return torch.cat(
            [self.chosen.double().unsqueeze(1), self.top_logprobs.double(), self.top_ids.double()],
            dim=1,
        )

    @staticmethod
    def unpack(rows: list[list[float]]) -> list[tuple[float, list[tuple[int, float]]]]:
        """`packed()` rows read back -> (chosen logprob, (token, logprob) alternatives) pairs."""
        k = (len(rows[0]) - 1) // 2 if rows else 0
        return [(v[0], list(zip(map(int, v[1 + k :]), v[1 : 1 + k]))) for v in rows]


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
    *,
    rows: torch.Tensor | Sequence[int] | None = None,
    num_top: int = 0,
    with_ranks: bool = False,
) -> TokenLogprobs:
    """Logprobs of `token_ids[i]` under row `rows[i]` of `logits` [R, V] (rows default to 0..N-1).

    `rows` lets beam search ask for several children of one parent row. `num_top` is the largest K
    any pair needs; slice per request after `TokenLogprobs.to_host()`. `with_ranks` adds each
    token's rank in its distribution (1 = the likeliest; ties share the better rank).
    """
    device = logits.device
    tokens = to_device(token_ids, device, torch.long)
    index = (
        torch.arange(len(tokens), device=device)
        if rows is None
        else to_device(rows, device, torch.long)
    )
    logp = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if num_top > 0:
        top = logp.topk(min(num_top, logp.shape[-1]), dim=-1)
        top_ids, top_lps = top.indices, top.values
    else:
        top_ids = torch.empty((len(tokens), 0), dtype=torch.long, device=device)
        top_lps = torch.empty((len(tokens), 0), dtype=torch.float32, device=device)
    ranks = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1 if with_ranks else None
    return TokenLogprobs(chosen=chosen, top_ids=top_ids, top_logprobs=top_lps, ranks=ranks)
