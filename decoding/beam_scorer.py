"""The scorer of one beam group: candidates, running beams and finished hypotheses.

Semantics are those of Hugging Face v4's `BeamSearchScorer` / `BeamHypotheses` (as in 4.4x-4.55):
- each step keeps K = max(2, 1 + #finishing ids) * W candidates over (beam, token), by
  `running score + processed log-prob`;
- walking them best first, a finishing (EOS / stop id) candidate becomes a finished hypothesis
  only if its rank is < W; other candidates continue until W beams are chosen;
- a finished hypothesis scores `sum_logprobs / generated_len ** length_penalty`, where
  generated_len counts the new tokens *including* the EOS; the set keeps the best W;
- `early_stopping`: True stops once W hypotheses are finished; False stops when the best
  candidate's sum over the current length cannot beat the worst kept hypothesis; "never" uses
  the maximum length instead when length_penalty > 0 (the exact bound);
- at the length limit the running beams join the set (unless already done) and the best
  `n` (num_return_sequences) are returned, best first.

Not in HF: when no candidate of a group is finite (a constraint left no beam a legal token), the
group stops and its running beams join the set with finish reason "no_legal_token" (HF would go
on with -inf beams).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from decoding.params import EarlyStopping
from decoding.top_k import largest
from decoding.transfer import to_device

FinishReason = Literal["stop", "length", "no_legal_token"]


@dataclass(frozen=True)
class BeamStep:
    parents: list[int]  # for each new beam: index of the input row it continues
    tokens: list[int]  # for each new beam: the token it appends
    done: bool  # run no more rows (not even these beams) and call finalize()
    # (input row, token) of each hypothesis finished at this step; with `parents`/`tokens` these
    # are every (row, token) a returned hypothesis can hold, e.g. to look up logprobs.
    finished: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens; ends with the finishing token when reason == "stop"
    score: float  # sum_logprobs / len(token_ids) ** length_penalty (HF `sequences_scores`)
    sum_logprobs: float  # processed log-probs summed (warped ones for beam sampling)
    finish_reason: FinishReason
    group: int = 0  # beam group it came from (group beam search)
    # rows[t]: index of the input row of step t that token_ids[t] was chosen from (HF's
    # beam_indices, relative to each step's rows): (t, rows[t], token_ids[t]) identifies it.
    rows: list[int] = field(default_factory=list)


class FinishedHypotheses:
    """The best `size` finished hypotheses and the stopping test (HF `BeamHypotheses`)."""

    def __init__(
        self, size: int, length_penalty: float, early_stopping: EarlyStopping, max_new_tokens: int
    ) -> None:
        self.size = size
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.beams: list[Hypothesis] = []  # insertion order matters for ties, as in HF
        self.worst_score = 1e9

    def __len__(self) -> int:
        return len(self.beams)

    def add(self, hyp: Hypothesis) -> None:
        if len(self.beams) < self.size or hyp.score > self.worst_score:
            self.beams.append(hyp)
            if len(self.beams) > self.size:
                ranked = sorted((h.score, i) for i, h in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(hyp.score, self.worst_score)

    def score(self, sum_logprobs: float, generated_len: int) -> float:
        return sum_logprobs / (generated_len**self.length_penalty)

    def is_done(self, best_sum_logprobs: float, generated_len: int) -> bool:
        """Can no running beam beat the worst kept hypothesis any more?"""
        if len(self.beams) < self.size:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best = self.score(best_sum_logprobs, self.max_new_tokens)
        else:  # False: HF's heuristic (exact for length_penalty <= 0)
            best = self.score(best_sum_logprobs, generated_len)
        return self.worst_score >= best


@dataclass
class Candidates:
    """K (score, row, token) candidates of one beam group, best score first."""

    scores: list[float]
    rows: list[int]
    tokens: list[int]


class BeamGroup:
    """One HF scorer: W running beams, their scores, and the finished set."""

    def __init__(
        self,
        size: int,
        finishing_ids: frozenset[int],
        length_penalty: float,
        early_stopping: EarlyStopping,
        max_new_tokens: int,
        index: int = 0,
    ) -> None:
        self.size = size
        self.index = index
        self.finishing_ids = finishing_ids
        self.num_candidates = max(2, 1 + len(finishing_ids)) * size
        self.max_new_tokens = max_new_tokens
        self.finished = FinishedHypotheses(size, length_penalty, early_stopping, max_new_tokens)
        self.beam_tokens: list[list[int]] = [[]]  # one empty beam: the prompt row
        self.beam_rows: list[list[int]] = [[]]  # input row of each step, per beam
        self.beam_scores = torch.zeros(1)  # float32 running sums, as HF keeps them
        self.scorer_done = False  # HF `_done`: stop, and do not add running beams at the end

    @property
    def generated(self) -> int:
        return len(self.beam_tokens[0]) if self.beam_tokens else 0

    @property
    def active(self) -> bool:
        return (
            bool(self.beam_tokens) and not self.scorer_done and self.generated < self.max_new_tokens
        )

    def accumulate(self, scores: torch.Tensor) -> torch.Tensor:
        """[rows * V] candidate scores: each row's processed log-probs + its running score."""
        running = to_device(self.beam_scores, scores.device)  # pinned: no sync on CUDA
        return (scores.float() + running.unsqueeze(1)).reshape(-1)

    def top_candidates(self, flat: torch.Tensor, vocab_size: int) -> Candidates:
        values, index = largest(flat.unsqueeze(0), min(self.num_candidates, flat.numel()))
        return _candidates(values[0], index[0], vocab_size)

    def sample_candidates(
        self, flat: torch.Tensor, vocab_size: int, generator: torch.Generator | None, num_beams: int
    ) -> Candidates:
        """Draw K candidates without replacement from softmax(flat), then sort them by score.

        Exponential race = `torch.multinomial(probs, K)` on CPU. On the first step HF's input has
        W rows (W-1 of them at -1e9, probability 0), so we draw W*V noise there to consume the
        generator exactly as HF does; only the first V values can matter.
        """
        probs = flat.unsqueeze(0).softmax(dim=-1)
        noise = torch.empty((1, max(flat.numel(), num_beams * vocab_size)), device=flat.device)
        noise.exponential_(generator=generator)
        k = min(self.num_candidates, flat.numel())
        index = (probs / noise[:, : flat.numel()]).topk(k).indices[0]
        values, order = flat[index].unsqueeze(0).sort(descending=True)
        return _candidates(values[0], index[order[0]], vocab_size)

    def advance(
        self, cand: Candidates, row_offset: int = 0
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """HF `BeamSearchScorer.process` for one group. `cand.rows` index this group's rows, which
        start at `row_offset` in the step's input. Returns the new beams' (parent rows, tokens)
        (group-local) and the (input row, token) of the hypotheses finished now."""
        length = self.generated + 1  # new tokens including the one chosen now
        if not cand.scores or cand.scores[0] == -math.inf:
            self.close("no_legal_token")
            return [], [], []
        parents: list[int] = []
        tokens: list[int] = []
        scores: list[float] = []
        finished: list[tuple[int, int]] = []
        for rank, (score, row, token) in enumerate(zip(cand.scores, cand.rows, cand.tokens)):
            if score == -math.inf:
                break  # sorted: nothing finite follows
            if token in self.finishing_ids:
                if rank >= self.size:
                    continue
                finished.append((row_offset + row, token))
                self.finished.add(
                    Hypothesis(
                        self.beam_tokens[row] + [token],
                        self.finished.score(score, length),
                        score,
                        "stop",
                        self.index,
                        self.beam_rows[row] + [row_offset + row],
                    )
                )
            else:
                parents.append(row)
                tokens.append(token)
                scores.append(score)
            if len(parents) == self.size:
                break
        if cand.scores:
            self.scorer_done = self.scorer_done or self.finished.is_done(cand.scores[0], length)
        self.beam_tokens = [self.beam_tokens[p] + [t] for p, t in zip(parents, tokens)]
        self.beam_rows = [self.beam_rows[p] + [row_offset + p] for p in parents]
        self.beam_scores = torch.tensor(scores, dtype=torch.float32)
        return parents, tokens, finished

    def close(self, reason: FinishReason = "length") -> None:
        """HF `finalize`: running beams join the finished set unless the scorer already stopped."""
        if not self.scorer_done:
            for tokens, rows, score in zip(
                self.beam_tokens, self.beam_rows, self.beam_scores.tolist()
            ):
                self.finished.add(
                    Hypothesis(
                        list(tokens),
                        self.finished.score(score, max(1, len(tokens))),
                        score,
                        reason,
                        self.index,
                        rows,
                    )
                )
            self.scorer_done = True
        self.beam_tokens = []


def host_pair(values: torch.Tensor, index: torch.Tensor) -> tuple[list, list]:
    """(values.tolist(), index.tolist()) of a top-k in one device-to-host copy, not two: float64
    holds both exactly (indices < 2**53)."""
    both = torch.stack([values.double(), index.double()]).tolist()
    if index.dim() > 1:
        return both[0], [[int(i) for i in row] for row in both[1]]
    return both[0], [int(i) for i in both[1]]


def _candidates(values: torch.Tensor, index: torch.Tensor, vocab_size: int) -> Candidates:
    values_l, flat = host_pair(values, index)
    return Candidates(values_l, [i // vocab_size for i in flat], [i % vocab_size for i in flat])


def best_hypotheses(groups: Sequence[BeamGroup], n: int) -> list[Hypothesis]:
    """The n best finished hypotheses over all groups, best first (HF's tie order)."""
    pool = [h for g in groups for h in g.finished.beams]
    ranked = sorted(pool, key=lambda h: h.score)  # stable, then taken from the end as HF pops
    return ranked[::-1][:n]
