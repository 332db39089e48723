"""N-gram speculation (prompt lookup): drafts from a row's own context, and how many a step keeps.

A row proposes up to k tokens by finding the last earlier occurrence of its trailing n-gram in its
own tokens (prompt and output) and copying what followed it (Saxena's prompt lookup decoding;
llama.cpp's `ngram-simple`, vLLM's `ngram` method). One forward then computes the row's pending
token and the k drafts, with logits at each of the k + 1 positions.

Verification chooses a token at every position exactly as a plain step would (the same processing,
the same uniform number for a sampled row's i-th output token) and keeps the drafts up to the first
one that differs from the chosen token, plus the chosen token there. For greedy rows that is the
argmax rule: output token-identical to no speculation. For sampled rows it is the standard
rejection rule for a draft that puts all its mass on one token: the draft `d` is accepted with
probability p(d), and on rejection the token is drawn from p with `d` removed (renormalised), which
is `max(p - q, 0)` normalised when q is the one-hot draft. Choosing with the same uniform numbers
makes it more than equal in distribution: a seeded row gives the same tokens with speculation on
and off, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.constraints import TokenConstraint

NGRAM_MAX = 3  # longest trailing n-gram looked up (longer matches first)
NGRAM_MIN = 2  # shortest: one token alone matches too often to be worth a draft


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX) of a token list last occurred, updated as the list
    grows: a lookup costs a few dictionary reads, whatever the context length."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._indexed = 0  # n-grams ending before this index are in the map

    def propose(self, tokens: Sequence[int], max_len: int) -> list[int]:
        """Up to `max_len` tokens that followed the last earlier occurrence of the longest
        trailing n-gram of `tokens` (empty when none occurred before)."""
        if max_len <= 0:
            return []
        self._catch_up(tokens)
        end = len(tokens)
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if end <= n:
                continue
            start = self._next.get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : min(start + max_len, end)])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that end before the last token (each maps to the token after it;
        the trailing n-gram itself is indexed once a token follows it)."""
        for stop in range(max(self._indexed, NGRAM_MIN), len(tokens)):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, stop) + 1):
                self._next[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, len(tokens))


def accepted_length(chosen: Sequence[int], draft: Sequence[int]) -> int:
    """How many leading drafts equal the tokens chosen at their positions (`chosen[j]` is the
    token chosen after the first j drafts)."""
    for j, token in enumerate(draft):
        if chosen[j] != token:
            return j
    return len(draft)


class DraftLength:
    """How many tokens a row drafts: it grows while drafts are accepted and shrinks when most are
    not. A row whose drafts gain too little (fewer than `min_gain` accepted per verifying step,
    on average over recent steps) pauses for `pause` proposals, then tries again with one draft:
    each draft costs a forward position and an LM-head row, a rejected one for nothing."""

    def __init__(
        self, max_len: int, min_gain: float = 0.5, warm_up: int = 4, pause: int = 16
    ) -> None:
        self.max_len = max_len
        self.length = max_len
        self.min_gain = min_gain
        self.warm_up = warm_up  # verifying steps before the gain may pause the row
        self.pause = pause
        self.gain = float(max_len)  # recent accepted drafts per verifying step (moving average)
        self.steps = 0  # verifying steps since the row (re)started drafting
        self.paused = 0  # proposals left to skip
        self.drafted = 0
        self.accepted = 0

    def drafts_now(self) -> bool:
        """Whether the row drafts at this proposal (a paused row counts the one it skips)."""
        if self.paused:
            self.paused -= 1
            if not self.paused:  # try again, carefully
                self.length, self.gain, self.steps = 1, float(self.max_len), 0
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts of this row and kept `accepted` of them."""
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        self.gain = 0.7 * self.gain + 0.3 * accepted if self.steps > 1 else float(accepted)
        if accepted == drafted:
            self.length = min(self.max_len, self.length * 2)
        elif accepted < drafted // 2:
            self.length = max(1, accepted + 1)
        if self.steps >= self.warm_up and self.gain < self.min_gain:
            self.paused = self.pause


@dataclass(eq=False)
class RowDrafts:
    """One row's speculation state: its n-gram index, its draft length, and for a constrained row
    its grammar's state after each draft of the step being verified."""

    length: DraftLength
    index: NgramIndex = field(default_factory=NgramIndex)
    constraints: list[TokenConstraint] = field(default_factory=list)
