"""Diverse (group) beam search (Vijayakumar et al. 2016), as HF 4.55 `_group_beam_search`.

`num_beams` beams split into `num_beam_groups` groups of S beams. Each group is its own beam
search (own running beams, own finished set and stopping test: `BeamGroup`). Within one step the
groups choose in order, and group g's log-probs are lowered by `diversity_penalty` times the
number of times each token was just chosen by the running beams of groups 0..g-1 (Hamming
diversity). At the end the finished sets of all groups are pooled and the best `n` returned.

Same engine contract as `BeamSearch`: one prompt row first (every group starts from it), then the
beams of the groups still running, group after group.

Deviations from HF, both deliberate:
- HF applies the Hamming term before the repetition penalty (its processor list order); the
  engine hands us fully processed scores, so we subtract it after. Every other processor is
  additive or a -inf mask and commutes; results differ only when repetition_penalty != 1.
- A group that is done stops using rows. HF keeps running it on pad tokens, whose pad ids then
  count in the Hamming term of later groups; here a done group contributes nothing.
"""

from __future__ import annotations

import torch

from decoding.beam_scorer import BeamGroup, BeamStep, Hypothesis, best_hypotheses
from decoding.beam_search import RequestSearch


class GroupBeamSearch(RequestSearch):
    strategies = ("group_beam",)

    _first = True  # the first step runs the prompt's one row for every group

    @property
    def done(self) -> bool:
        return not any(g.active for g in self.groups)

    @property
    def num_rows(self) -> int:
        if self.done:
            return 0
        return 1 if self._first else sum(len(g.beam_tokens) for g in self.groups if g.active)

    def step(self, scores: torch.Tensor) -> BeamStep:
        """Advance every running group with the processed scores [num_rows, V] of its rows."""
        if self.done:
            raise RuntimeError("group beam search is done; call finalize()")
        if scores.shape[0] != self.num_rows:
            raise ValueError(f"expected {self.num_rows} rows of scores, got {scores.shape[0]}")
        vocab = scores.shape[-1]
        chosen: list[int] = []  # tokens taken this step by the running beams of earlier groups
        new_beams: list[tuple[BeamGroup, list[int], list[int]]] = []
        finished: list[tuple[int, int]] = []
        offset = 0
        for group in self.groups:
            if not group.active:
                continue
            rows = 1 if self._first else len(group.beam_tokens)
            start = 0 if self._first else offset
            offset += 0 if self._first else rows
            group_scores = scores[start : start + rows]
            if chosen and self.params.diversity_penalty:
                counts = torch.bincount(torch.tensor(chosen), minlength=vocab).to(scores.device)
                group_scores = group_scores - self.params.diversity_penalty * counts
            cand = group.top_candidates(group.accumulate(group_scores), vocab)
            parents, tokens, done_now = group.advance(cand, row_offset=start)
            finished += done_now
            chosen += tokens
            new_beams.append((group, [start + p for p in parents], tokens))
        self._first = False
        done = self.done
        # Rows to run: beams of groups still running. Once done: beams that can still join the
        # result (groups that stopped by their own test drop theirs, as HF does).
        keep = [(ps, ts) for g, ps, ts in new_beams if (not g.scorer_done if done else g.active)]
        return BeamStep(
            [p for ps, _ in keep for p in ps], [t for _, ts in keep for t in ts], done, finished
        )

    def finalize(self) -> list[Hypothesis]:
        """The `n` best hypotheses over all groups, best first. Ends the search."""
        for group in self.groups:
            group.close()
        return best_hypotheses(self.groups, self.params.n)
