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

vLLM's `allowed_token_ids` is a mask of the same kind (no state: the same tokens at every step),
alone or on top of a grammar; unlike a grammar it allows no ending token it does not list.

When the constraint, `min_tokens`, `bad_words` and `logit_bias` together leave a row no token at
all, the row ends with `NO_LEGAL_TOKEN`, or with "stop" if its output already completes the
constraint (e.g. `ignore_eos` with a finished grammar); it never emits an illegal token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decoding.transfer import to_device

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
    """The banned tokens of the constrained rows of one step, as runs of adjacent rows (a
    request's rows are adjacent, so there are at most as many runs as constrained requests)."""

    runs: list[tuple[int, int]]  # [start, stop) rows of the step, in order
    banned: torch.Tensor  # [C, V] bool: the runs' rows, concatenated

    @property
    def row_list(self) -> list[int]:
        return [r for start, stop in self.runs for r in range(start, stop)]


def build_constraint_mask(
    constraints: Sequence[TokenConstraint | None],
    finishing_ids: Sequence[frozenset[int]],
    eos_ids: Iterable[int],
    vocab_size: int,
    device: torch.device | str,
    allowed: Sequence[tuple[int, ...] | None] | None = None,
) -> ConstraintMask | None:
    """The mask of every constrained row (None when no row has a constraint).

    `finishing_ids[r]`: the tokens that end row r (its request's stop ids, and EOS unless
    ignored); `eos_ids`: the model's EOS ids, which a constraint never allows by itself.
    `allowed[r]`: vLLM's `allowed_token_ids` of row r, if any: only they may be chosen, the
    ending tokens included (a row with them alone is a constrained row too).
    """
    allowed = allowed if allowed is not None else [None] * len(constraints)
    rows = [r for r, (c, a) in enumerate(zip(constraints, allowed)) if c is not None or a]
    if not rows:
        return None
    # Allowed tokens as bits (llguidance's layout) until the step's device unpacks them: on a
    # GPU the copy is V / 8 bytes a row, not V (262k-entry vocabulary: 32 KiB, not 256 KiB).
    bitmask = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
    words = bitmask.numpy().view(np.uint32)  # the same memory, bits without a sign
    eos = set(eos_ids)
    for i, r in enumerate(rows):
        constraint = constraints[r]
        if constraint is not None:
            constraint.fill_allowed(bitmask, i)
            ends = [t for t in eos | finishing_ids[r] if t < vocab_size]
            _set_bits(words[i], ends, False)  # never allowed by the constraint alone
            if constraint.accepting:
                _set_bits(words[i], [t for t in finishing_ids[r] if t < vocab_size], True)
        else:
            words[i] = 0xFFFFFFFF  # every bit set: the allowed ids below are the only limit
        ids = allowed[r]
        if ids:
            keep = np.zeros(words.shape[1] * 32, dtype=np.uint8)
            keep[[t for t in ids if t < vocab_size]] = 1
            words[i] &= np.packbits(keep, bitorder="little").view(np.uint32)
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    if torch.device(device).type == "cpu":
        banned = _unpack_bits(torch.bitwise_not(bitmask), vocab_size)
    else:
        banned = banned_on_device(to_device(bitmask, device), vocab_size)
    return ConstraintMask(runs, banned)


def _set_bits(words: np.ndarray, tokens: Sequence[int], value: bool) -> None:
    """Set (`value`) or clear the bits of `tokens` in one row's uint32 words."""
    if not tokens:
        return
    ids = np.asarray(tokens, dtype=np.int64)
    bits = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    if value:
        np.bitwise_or.at(words, ids >> 5, bits)
    else:
        np.bitwise_and.at(words, ids >> 5, ~bits)


def banned_on_device(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [C, vocab_size], True where a bit of the int32 `bitmask` [C, W] is clear, computed
    where the bitmask is (on a GPU: a few element-wise kernels over the packed words)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 reads right too
    return (bits == 0).flatten(1)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [C, W] -> bool [C, vocab_size] (little-endian words, as llguidance writes)."""
    return _unpack_bits(bitmask, vocab_size)


def _unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bit b of word w of each row -> entry 32 w + b. numpy's unpackbits: 6x torch's bitwise
    ops on a 262k vocabulary."""
    raw = words.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(raw, axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab_size]


def apply_constraint_mask_(scores: torch.Tensor, mask: ConstraintMask) -> None:
    """Set the banned tokens of the constrained rows of `scores` [R, V] to -inf, in place (on
    views of each run of rows: no gather, no scatter)."""
    offset = 0
    for start, stop in mask.runs:
        n = stop - start
        scores[start:stop].masked_fill_(mask.banned[offset : offset + n], float("-inf"))
        offset += n


def dead_rows(scores: torch.Tensor, mask: ConstraintMask | None) -> torch.Tensor | None:
    """[C] bool on the device: whether each constrained row has nothing left (None: no rows)."""
    if mask is None:
        return None
    return torch.isneginf(torch.cat([scores[start:stop].amax(dim=-1) for start, stop in mask.runs]))


def read_dead_rows(dead: list[bool] | list[int], mask: ConstraintMask | None) -> set[int]:
    """`dead_rows` read back -> the rows (of the step) without a token."""
    return set() if mask is None else {r for r, d in zip(mask.row_list, dead) if d}


def _int32(value: int) -> int:
    """An unsigned 32-bit word as the signed int32 torch stores."""
    return value - (1 << 32) if value >= 1 << 31 else value
