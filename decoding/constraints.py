"""Constraints on the tokens a row may choose next, applied as one vectorised mask per step.

A constraint is per-row state (`TokenConstraint`): it says which tokens may come next, advances
with the row's chosen token, and forks with the row (`n` / `best_of` samples, beams: a child takes
a copy of its parent's state). Grammars (decoding/grammar.py) and forced prefixes (`ForcedPrefix`,
fairseq's `prefix_tokens`) are the two kinds.

The mask is applied where Hugging Face's `PrefixConstrainedLogitsProcessor` applies it: on raw
logits for greedy and sampled rows, and for beam rows on the log-probabilities after
`log_softmax`, so beam scores are not renormalised over the allowed tokens. It comes before the
other processors and warpers (it only writes -inf, which every processor keeps).

Tokens that end a row (the model's EOS and the request's `stop_token_ids`) are allowed exactly
where the constraint is complete (`accepting`), whatever else the constraint says about them: a
finished grammar can only end, an unfinished one cannot. Rows without a constraint cost nothing.

When the constraint, `min_tokens`, `bad_words` and `logit_bias` together leave a row no token at
all, the row ends with `NO_LEGAL_TOKEN`, or with "stop" if its output already completes the
constraint (e.g. `ignore_eos` with a finished grammar); it never emits an illegal token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

NO_LEGAL_TOKEN = "no_legal_token"  # finish reason: nothing was left to choose


class TokenConstraint(Protocol):
    """One row's constraint state."""

    @property
    def accepting(self) -> bool:
        """The tokens consumed so far complete the constraint (the row may end here)."""
        ...

    def fill_allowed(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of an int32 CPU bitmask
        [rows, ceil(V / 32)] (bit b of word w: token 32 w + b)."""
        ...

    def advance(self, token: int) -> bool:
        """Consume the row's chosen token; False if the constraint did not allow it."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy of this state, for a row forked from this one."""
        ...


class ForcedPrefix:
    """Every output begins with `prefix` (token ids); anything may follow. The forced tokens
    count and are scored as output, as fairseq's `prefix_tokens` are."""

    def __init__(self, prefix: Sequence[int], position: int = 0) -> None:
        if not prefix:
            raise ValueError("a forced prefix needs at least one token")
        self.prefix = tuple(prefix)
        self.position = position

    @property
    def accepting(self) -> bool:
        return self.position >= len(self.prefix)

    def fill_allowed(self, bitmask: torch.Tensor, index: int) -> None:
        if self.accepting:
            bitmask[index] = -1  # every bit set
            return
        bitmask[index] = 0
        token = self.prefix[self.position]
        word, bit = divmod(token, 32)
        bitmask[index, word] = _int32(1 << bit)

    def advance(self, token: int) -> bool:
        ok = self.accepting or token == self.prefix[self.position]
        self.position += 1
        return ok

    def fork(self) -> ForcedPrefix:
        return ForcedPrefix(self.prefix, self.position)


@dataclass
class ConstraintMask:
    """The allowed tokens of the constrained rows of one step."""

    rows: torch.Tensor  # [C] long: which rows of the step are constrained
    row_list: list[int]
    allowed: torch.Tensor  # [C, V] bool


def build_constraint_mask(
    constraints: Sequence[TokenConstraint | None],
    finishing_ids: Sequence[frozenset[int]],
    eos_ids: Iterable[int],
    vocab_size: int,
    device: torch.device | str,
) -> ConstraintMask | None:
    """The mask of every constrained row (None when no row has a constraint).

    `finishing_ids[r]`: the tokens that end row r (its request's stop ids, and EOS unless
    ignored); `eos_ids`: the model's EOS ids, which a constraint never allows by itself.
    """
    rows = [r for r, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    bitmask = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    for i, r in enumerate(rows):
        constraint = constraints[r]
        assert constraint is not None
        constraint.fill_allowed(bitmask, i)
    allowed = unpack_bitmask(bitmask, vocab_size)
    eos = set(eos_ids)
    for i, r in enumerate(rows):
        ends = sorted(t for t in eos | finishing_ids[r] if t < vocab_size)
        if ends:
            constraint = constraints[r]
            assert constraint is not None
            allowed[i, ends] = False
            if constraint.accepting:
                allowed[i, sorted(t for t in finishing_ids[r] if t < vocab_size)] = True
    return ConstraintMask(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        row_list=rows,
        allowed=allowed.to(device),
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [C, W] -> bool [C, vocab_size] (little-endian words, as llguidance writes)."""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [C, 4 W]: byte k holds tokens 8k..8k+7
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [C, 4 W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_constraint_mask_(scores: torch.Tensor, mask: ConstraintMask) -> None:
    """Set the disallowed tokens of the constrained rows of `scores` [R, V] to -inf, in place."""
    scores[mask.rows] = scores[mask.rows].masked_fill(~mask.allowed, float("-inf"))


def rows_without_tokens(scores: torch.Tensor, mask: ConstraintMask | None) -> set[int]:
    """Constrained rows whose processed `scores` leave no token to choose."""
    if mask is None:
        return set()
    dead = torch.isneginf(scores[mask.rows]).all(dim=-1).tolist()
    return {r for r, d in zip(mask.row_list, dead) if d}


def _int32(value: int) -> int:
    """An unsigned 32-bit word as the signed int32 torch stores."""
    return value - (1 << 32) if value >= 1 << 31 else value
