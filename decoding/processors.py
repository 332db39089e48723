"""Logits processors (penalties, bans, bias) for a batch of rows that each carry their own params.

Order, as Hugging Face `generate()` builds its list (`_get_logits_processor`): logit bias (HF
`sequence_bias`), repetition penalty, [presence/frequency: OpenAI, not in HF; placed right after
the repetition penalty as vLLM does], no-repeat-n-gram, bad words, min new tokens, forced BOS /
EOS. No-repeat-n-gram, bad words and min new tokens only ban tokens (-inf), so they commute with
everything and are merged into one list of bans; bias and the repetition penalty do not commute,
hence bias first like HF (vLLM too). A forced token comes last: its row's scores become -inf but
its own, which becomes 0 (a beam's score gains nothing at that step, as in `generate()`).

Everything that depends on the token history is computed in `build_processor_tensors` as sparse
(row, token) pairs: applying them touches only those entries (gather / scatter like HF's
repetition penalty), never a dense [R, V] mask. A processor no row uses builds nothing and costs
nothing. The penalties of a row kept in a `PenaltyTable` (penalty_table.py: its distinct tokens
and counts on the device, updated token by token) cost no Python per history token at all.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from decoding.params import DecodingParams
from decoding.penalty_table import PenaltyRow, TablePenalties
from decoding.timestamps import TimestampRows, apply_timestamp_rules_, timestamp_rows
from decoding.transfer import to_device

TokenIds = Sequence[int]


@dataclass
class Pairs:
    """Entries (rows[i], tokens[i]) of a [R, V] score matrix, with one value each."""

    rows: torch.Tensor  # [N] long
    tokens: torch.Tensor  # [N] long
    values: torch.Tensor  # [N] float32 (unused for bans)


class PairsBuilder:
    """Collects every row's entries in flat lists, turned into tensors once per step: per-row
    tensors, or `torch.tensor` over a long Python list, cost more than the data."""

    def __init__(self) -> None:
        self.tokens = array("q")
        self.counts: list[int] = []  # entries per added chunk
        self.rows: list[int] = []  # row of each chunk
        self.values: list[float] = []  # one per chunk (a scalar) or per entry
        self.per_entry = False

    def add(
        self, row: int, tokens: Sequence[int] | torch.Tensor, values: float | Sequence[float]
    ) -> None:
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        if not len(ids):
            return
        self.tokens.extend(ids)
        self.counts.append(len(ids))
        self.rows.append(row)
        if isinstance(values, (int, float)):
            self.values.append(float(values))
        else:  # values per entry: expand the chunks so far, keep entries from now on
            if not self.per_entry:
                self.values = [v for v, c in zip(self.values, self.counts) for _ in range(c)]
                self.per_entry = True
            self.values.extend(values)
            return
        if self.per_entry:
            self.values[-1:] = [self.values[-1]] * len(ids)

    def build(self, vocab_size: int, device: torch.device | str) -> Pairs | None:
        if not self.rows:
            return None
        counts = torch.tensor(self.counts)
        values = torch.tensor(self.values, dtype=torch.float32)
        if not self.per_entry:
            values = values.repeat_interleave(counts)
        return _pairs(self.tokens, torch.tensor(self.rows), counts, values, vocab_size, device)


class CountPairsBuilder:
    """Entries valued `scale * count + offset`, each row with its own scale and offset (the
    frequency and presence penalties), computed as tensors (in float64, then float32: what
    Python's arithmetic on the same numbers gives)."""

    def __init__(self) -> None:
        self.tokens = array("q")
        self.counts = array("d")
        self.sizes: list[int] = []
        self.rows: list[int] = []
        self.scales: list[float] = []
        self.offsets: list[float] = []

    def add(
        self, row: int, tokens: Sequence[int], counts: Sequence[float], scale: float, offset: float
    ) -> None:
        if not len(tokens):
            return
        self.tokens.extend(tokens)
        self.counts.extend(counts)
        self.sizes.append(len(tokens))
        self.rows.append(row)
        self.scales.append(scale)
        self.offsets.append(offset)

    def build(self, vocab_size: int, device: torch.device | str) -> Pairs | None:
        if not self.rows:
            return None
        sizes = torch.tensor(self.sizes)
        f64 = torch.float64
        counts = torch.frombuffer(self.counts, dtype=f64)
        scales = torch.tensor(self.scales, dtype=f64).repeat_interleave(sizes)
        values = scales * counts + torch.tensor(self.offsets, dtype=f64).repeat_interleave(sizes)
        rows = torch.tensor(self.rows)
        return _pairs(self.tokens, rows, sizes, values.float(), vocab_size, device)


def _pairs(
    flat_tokens: array,  # type: ignore[type-arg]
    chunk_rows: torch.Tensor,
    chunk_sizes: torch.Tensor,
    values: torch.Tensor,
    vocab_size: int,
    device: torch.device | str,
) -> Pairs:
    tokens = torch.frombuffer(flat_tokens, dtype=torch.long)
    rows = chunk_rows.repeat_interleave(chunk_sizes)
    if np.frombuffer(flat_tokens, dtype=np.int64).max() >= vocab_size:  # the API rejects these;
        keep = tokens < vocab_size  # never crash a shared batch
        tokens, rows, values = tokens[keep], rows[keep], values[keep]
    return Pairs(to_device(rows, device), to_device(tokens, device), to_device(values, device))


def uses_penalties(p: DecodingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


@dataclass
class ProcessorTensors:
    logit_bias: Pairs | None = None  # value: bias
    repetition: Pairs | None = None  # value: penalty; one pair per token of prompt + output
    presence_frequency: Pairs | None = None  # value: frequency * count + presence, output tokens
    banned: Pairs | None = None  # n-gram, bad words, min tokens, begin suppression
    forced: Pairs | None = None  # rows whose next token is forced (forced BOS / EOS)
    kept: TablePenalties | None = None  # all three penalties of the rows kept in a table
    timestamps: TimestampRows | None = None  # Whisper's rows with timestamps (timestamps.py)

    @property
    def empty(self) -> bool:
        return all(v is None for v in vars(self).values())


def build_processor_tensors(
    params: Sequence[DecodingParams],
    prompt_ids: Sequence[TokenIds],
    output_ids: Sequence[TokenIds],
    eos_ids: Sequence[int] | frozenset[int],
    vocab_size: int,
    device: torch.device | str,
    penalty_rows: Sequence[PenaltyRow | None] | None = None,
    with_bias: bool = True,
) -> ProcessorTensors:
    """Per-row processor entries from each row's params and its prompt and output token ids (read
    only for the rows whose processors need them), the penalties from the row's table where
    `penalty_rows` has one (the same values, gathered on the device); fields stay None when no
    row uses that processor. `with_bias` False leaves the logit bias out: it depends on the
    params alone, and the caller keeps it between steps (`logit_bias_pairs`)."""
    repetition, bans, forced = PairsBuilder(), PairsBuilder(), PairsBuilder()
    penalties = CountPairsBuilder()
    kept: list[tuple[int, PenaltyRow, DecodingParams]] = []
    for r, p in enumerate(params):
        state = penalty_rows[r] if penalty_rows is not None else None
        if state is not None and uses_penalties(p):
            if state.columns:  # a row with no token yet has nothing to penalize
                kept.append((r, state, p))
        elif p.repetition_penalty != 1.0:  # repeated tokens are harmless: equal writes of a value
            repetition.add(r, [*prompt_ids[r], *output_ids[r]], p.repetition_penalty)
        if state is None and (p.presence_penalty or p.frequency_penalty):
            counted = Counter(output_ids[r])
            counts = [float(c) for c in counted.values()]
            penalties.add(r, list(counted), counts, p.frequency_penalty, p.presence_penalty)
        if p.no_repeat_ngram_size:
            history = torch.tensor(list(prompt_ids[r]) + list(output_ids[r]), dtype=torch.long)
            bans.add(r, ngram_bans(history, p.no_repeat_ngram_size), 0.0)
        if p.bad_words_ids:
            bans.add(r, bad_word_bans(prompt_ids[r], output_ids[r], p.bad_words_ids, eos_ids), 0.0)
        if p.min_tokens and len(output_ids[r]) < p.min_tokens:
            bans.add(r, sorted(p.finishing_ids(eos_ids)), 0.0)
        if p.begin_suppress_tokens and not output_ids[r]:
            bans.add(r, list(p.begin_suppress_tokens), 0.0)
        if p.forced_bos_token_id is not None or p.forced_eos_token_ids:
            made = len(output_ids[r])
            if made == 0 and p.forced_bos_token_id is not None:
                forced.add(r, [p.forced_bos_token_id], 0.0)
            elif made == p.max_tokens - 1 and p.forced_eos_token_ids:
                forced.add(r, list(p.forced_eos_token_ids), 0.0)
    return ProcessorTensors(
        logit_bias=(
            logit_bias_pairs([p.logit_bias for p in params], vocab_size, device)
            if with_bias
            else None
        ),
        repetition=repetition.build(vocab_size, device),
        presence_frequency=penalties.build(vocab_size, device),
        banned=bans.build(vocab_size, device),
        forced=forced.build(vocab_size, device),
        kept=_gather_kept(kept) if kept else None,
        timestamps=timestamp_rows([p.timestamp_rules for p in params], output_ids, device),
    )


def logit_bias_pairs(
    biases: Sequence[Mapping[int, float] | None], vocab_size: int, device: torch.device | str
) -> Pairs | None:
    """The logit bias entries of rows with these `biases` (None or empty: none)."""
    bias = PairsBuilder()
    for r, b in enumerate(biases):
        if b:
            bias.add(r, list(b), list(b.values()))
    return bias.build(vocab_size, device)


def _gather_kept(kept: list[tuple[int, PenaltyRow, DecodingParams]]) -> TablePenalties:
    table = kept[0][1].table
    return table.gather(
        [r for r, _, _ in kept],
        [state for _, state, _ in kept],
        [p.repetition_penalty for _, _, p in kept],
        [p.frequency_penalty for _, _, p in kept],
        [p.presence_penalty for _, _, p in kept],
    )


def apply_processors_(scores: torch.Tensor, t: ProcessorTensors) -> torch.Tensor:
    """Process `scores` [R, V] in place (the caller owns it) and return it."""
    if t.logit_bias is not None:
        b = t.logit_bias
        scores.index_put_((b.rows, b.tokens), b.values, accumulate=True)
    if t.kept is not None:  # its rows get no pairs below
        t.kept.apply_(scores)
    if t.repetition is not None:
        rp = t.repetition
        old = scores[rp.rows, rp.tokens]
        # HF semantics: push the score toward "less likely" whatever its sign.
        scores[rp.rows, rp.tokens] = torch.where(old < 0, old * rp.values, old / rp.values)
    if t.presence_frequency is not None:
        pf = t.presence_frequency
        scores.index_put_((pf.rows, pf.tokens), -pf.values, accumulate=True)
    if t.banned is not None:
        scores[t.banned.rows, t.banned.tokens] = float("-inf")
    if t.forced is not None:
        f = t.forced
        scores.index_fill_(0, f.rows.unique(), float("-inf"))
        scores[f.rows, f.tokens] = 0.0
    if t.timestamps is not None:  # last: they read what every other processor left
        apply_timestamp_rules_(scores, t.timestamps)
    return scores


def ngram_bans(history: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens that would repeat an n-gram of `history` (prompt + output), as HF bans them.

    The next token completes the n-gram (last n-1 tokens, next); every earlier window whose first
    n-1 tokens equal that suffix bans its own last token.
    """
    length = history.shape[0]
    if length < n:
        return history.new_empty(0)
    windows = history.unfold(0, n, 1)  # [length - n + 1, n]
    suffix = history[length - n + 1 :]
    match = (windows[:, :-1] == suffix).all(dim=1)
    return windows[match, -1].unique()


def bad_word_bans(
    prompt: TokenIds,
    output: TokenIds,
    bad_words: Sequence[Sequence[int]],
    eos_ids: Sequence[int] | frozenset[int],
) -> list[int]:
    """Last tokens of bad words whose other tokens end the history (single tokens: always).

    As HF's NoBadWordsLogitsProcessor, a bad word that is exactly one EOS id is ignored, so a
    client cannot forbid the model from ever ending.
    """
    eos = set(eos_ids)
    banned: list[int] = []
    tail: list[int] | None = None
    longest = max(len(w) for w in bad_words) - 1
    for word in bad_words:
        if len(word) == 1:
            if word[0] not in eos:
                banned.append(word[0])
            continue
        if tail is None:  # only the last `longest` tokens can matter
            tail = (list(prompt) + list(output))[-longest:] if longest else []
        k = len(word) - 1
        if k <= len(tail) and tail[len(tail) - k :] == list(word[:-1]):
            banned.append(word[-1])
    return banned
