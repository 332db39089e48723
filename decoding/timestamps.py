"""Whisper's timestamp rules (openai-whisper's `ApplyTimestampRules`, transformers'
`WhisperTimeStampLogitsProcessor`), for the rows of a batch that decode with timestamps.

A Whisper transcript with timestamps is segments `<|t0|> text <|t1|>`, its timestamp tokens the
ids from `timestamp_begin` (0.00 s) on, one per 20 ms. Before each choice, for each such row:
`<|notimestamps|>` is never chosen; after a timestamp that closes a pair (two in a row, or one
first) the next token is text or EOS, after one that opens a pair it is a timestamp or EOS;
timestamps never go back (and the same one is not repeated unless it closes a pair); the first
token is a timestamp, at most `max_initial_index` steps (1 s) in; and when the timestamps'
probability together is above every text token's, the row must choose a timestamp.

What depends on a row's history (its last two tokens, its last timestamp, whether it has any
output) is read on the host when the step's processor tensors are built (`timestamp_rows`); the
masking is tensor ops over all such rows at once (`apply_timestamp_rules_`), after every other
processor, as transformers orders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TokenIds = Sequence[int]


@dataclass(frozen=True)
class TimestampRules:
    """A Whisper model's timestamp tokens (the generation config's)."""

    timestamp_begin: int  # <|0.00|>: no_timestamps_token_id + 1
    no_timestamps: int
    eos: int
    max_initial_index: int | None = 50  # the first timestamp at most this many steps in


@dataclass
class TimestampRows:
    """The step's rows under timestamp rules, and what their histories say (all [N])."""

    rows: torch.Tensor  # long: indexes into the step's rows
    text_only: torch.Tensor  # bool: the last timestamp closed a pair: no timestamp next
    no_text: torch.Tensor  # bool: the last timestamp opened a pair: no text token next
    lowest: torch.Tensor  # long: the lowest timestamp token allowed
    first: torch.Tensor  # bool: no output yet: a timestamp, and an early one
    rules: TimestampRules


def timestamp_rows(
    rules: Sequence[TimestampRules | None],
    output_ids: Sequence[TokenIds],
    device: torch.device | str,
) -> TimestampRows | None:
    """The rows with rules (`rules[r]` not None; one model's, so all equal), from their outputs."""
    picked = [r for r, rule in enumerate(rules) if rule is not None]
    if not picked:
        return None
    rule = rules[picked[0]]
    assert rule is not None
    begin = rule.timestamp_begin
    text_only, no_text, lowest, first = [], [], [], []
    for r in picked:
        seq = output_ids[r]
        last = len(seq) >= 1 and seq[-1] >= begin
        penultimate = len(seq) < 2 or seq[-2] >= begin
        text_only.append(last and penultimate)
        no_text.append(last and not penultimate)
        latest = next((t for t in reversed(seq) if t >= begin), None)  # from the end: O(text)
        if latest is None:
            lowest.append(begin)
        else:
            lowest.append(latest if last and not penultimate else latest + 1)
        first.append(len(seq) == 0)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return TimestampRows(
        rows=tensor(picked, torch.long),
        text_only=tensor(text_only, torch.bool),
        no_text=tensor(no_text, torch.bool),
        lowest=tensor(lowest, torch.long),
        first=tensor(first, torch.bool),
        rules=rule,
    )


def apply_timestamp_rules_(scores: torch.Tensor, t: TimestampRows) -> None:
    """Mask `scores` [R, V] in place on the rows of `t` (module docstring)."""
    rule = t.rules
    begin = rule.timestamp_begin
    part = scores.index_select(0, t.rows)  # [N, V]
    vocab = torch.arange(part.shape[-1], device=part.device)
    stamp = vocab >= begin  # [V]
    masked = (vocab == rule.no_timestamps).expand_as(part).clone()
    masked |= t.text_only[:, None] & stamp
    masked |= t.no_text[:, None] & (vocab < rule.eos)
    masked |= stamp & (vocab < t.lowest[:, None])
    masked |= t.first[:, None] & ~stamp
    if rule.max_initial_index is not None:
        masked |= t.first[:, None] & (vocab > begin + rule.max_initial_index)
    part = part.masked_fill(masked, float("-inf"))
    logprobs = part.float().log_softmax(dim=-1)
    stamps_likelier = logprobs[:, begin:].logsumexp(dim=-1) > logprobs[:, :begin].max(dim=-1).values
    part[:, :begin] = part[:, :begin].masked_fill(stamps_likelier[:, None], float("-inf"))
    scores.index_copy_(0, t.rows, part)
