"""Word timestamps from cross-attention, as openai-whisper finds them (faster-whisper does the
same): the decoder reads a window's text once more, teacher-forced after `<|notimestamps|>`, and
the scores of the model's alignment heads (model/seq2seq/whisper.py) say which audio each token
attended to. Per head they are a softmax over the window's audio positions, normalized over the
tokens and median-filtered along time; the heads' mean, negated, is the cost of a monotonic path
from the first token to the last (dynamic time warping). A token starts where the path first
reaches its row; a word (its tokens, split at spaces, or at every character in languages written
without them) spans from its first token's start to the next word's.

Then openai-whisper's corrections: punctuation joins its neighbour word, a word at a sentence's
edge is cut to twice the window's median word length, and a segment's first and last word keep
to the segment's own times where the attention strays (`place_words`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from server.audio.segments import Segment, Word

POSITIONS_PER_SECOND = 50  # encoder positions: 1,500 in a 30-second window
MEDIAN_FILTER_WIDTH = 7
PREPENDED = "\"'“¿([{-"  # openai-whisper's defaults
APPENDED = "\"'.。,，!！?？:：”)]}、"
SENTENCE_ENDS = ".。!！?？"
UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The median of each `width` neighbours along the last dimension, the edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    rows = x.reshape(-1, 1, x.shape[-1])  # reflection pads the last dimension of 3-d input
    padded = torch.nn.functional.pad(rows, (pad, pad), mode="reflect")
    medians = padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad]
    return medians.reshape(x.shape)


def attention_cost(scores: torch.Tensor, frames: int) -> torch.Tensor:
    """[tokens, positions] of the heads' scores [heads, tokens, source] over the window's
    `frames` of audio (two frames a position): the heads' mean of their softmax over those
    positions, normalized over the tokens and median-filtered."""
    weights = scores[:, :, : frames // 2].float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    return weights.mean(dim=0)


def dynamic_time_warping(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [N, M] from (0, 0) to (N-1, M-1), as (row,
    column) index arrays; ties prefer the diagonal step, then the step down, then the step
    right (openai-whisper's order). Filled one anti-diagonal at a time: every cell of one
    depends only on the two before it."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    total[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for diagonal in range(2, n + m + 1):
        i = np.arange(max(1, diagonal - m), min(n, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        total[i, j] = cost[i - 1, j - 1] + np.choose(step, (c0, c1, c2))
        trace[i, j] = step
    trace[0, :], trace[:, 0] = 2, 1
    rows, columns = [], []
    i, j = n, m
    while i > 0 or j > 0:
        rows.append(i - 1)
        columns.append(j - 1)
        move = trace[i, j]
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(columns[::-1])


def split_words(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], end_of_text: int, language: str | None
) -> tuple[list[str], list[list[int]]]:
    """`tokens` as words and their tokens: pieces that decode to whole characters, joined into
    words at spaces (each punctuation mark and special token a word of its own), except in
    languages written without spaces."""
    pieces, piece_tokens = _whole_characters(tokenizer, tokens)
    if language in UNSPACED_LANGUAGES:
        return pieces, piece_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for piece, ids in zip(pieces, piece_tokens):
        starts_word = ids[0] >= end_of_text or piece.startswith(" ")
        if starts_word or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1] += ids
    return words, word_tokens


def _whole_characters(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int]
) -> tuple[list[str], list[list[int]]]:
    """Consecutive tokens grouped so that each group decodes to whole characters."""
    whole = str(tokenizer.decode(tokens, skip_special_tokens=False))
    pieces: list[str] = []
    piece_tokens: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for token in tokens:
        current.append(token)
        text = str(tokenizer.decode(current, skip_special_tokens=False))
        broken = text.find("\ufffd")
        if broken < 0 or (offset + broken < len(whole) and whole[offset + broken] == "\ufffd"):
            pieces.append(text)
            piece_tokens.append(current)
            current = []
            offset += len(text)
    return pieces, piece_tokens


@dataclass
class Timed:
    """A word being placed: its text, tokens and times in its window."""

    word: str
    tokens: list[int]
    start: float
    end: float


def window_words(
    tokenizer: PreTrainedTokenizerBase,
    scores: torch.Tensor,
    frames: int,
    prompt_len: int,
    text: list[int],
    end_of_text: int,
    language: str | None,
) -> list[Timed]:
    """The words of a window's `text` tokens with their times in the window, from the
    cross-attention `scores` [heads, decoder positions, source] of the decoder prompt (its
    `prompt_len` tokens, `<|notimestamps|>` last), the text and the end of text."""
    words, word_tokens = split_words(tokenizer, [*text, end_of_text], end_of_text, language)
    if len(word_tokens) <= 1:
        return []
    # the rows whose query chose a text token or the end: from <|notimestamps|> to the last text
    cost = attention_cost(scores, frames)[prompt_len - 1 : -1]
    rows, columns = dynamic_time_warping(-cost.double().numpy())
    jumps = np.diff(rows, prepend=-1).astype(bool)
    times = columns[jumps] / POSITIONS_PER_SECOND
    bounds = np.cumsum([0, *(len(t) for t in word_tokens[:-1])])
    timed = [
        Timed(word, ids, float(times[begin]), float(times[end]))
        for word, ids, begin, end in zip(words, word_tokens, bounds[:-1], bounds[1:])
    ]
    _cut_at_sentence_ends(timed)
    _merge_punctuation(timed)
    return timed


def median_word_seconds(timed: list[Timed]) -> float:
    """The window's median word length (its words of some length), at most 0.7 s."""
    lengths = [w.end - w.start for w in timed if w.end > w.start]
    return min(0.7, float(np.median(lengths))) if lengths else 0.0


def _cut_at_sentence_ends(timed: list[Timed]) -> None:
    """A word that ends or follows a sentence is at most twice the median word long."""
    longest = 2 * median_word_seconds(timed)
    if not longest:
        return
    for before, word in zip(timed, timed[1:]):
        if word.end - word.start > longest:
            if word.word in SENTENCE_ENDS:
                word.end = word.start + longest
            elif before.word in SENTENCE_ENDS:
                word.start = word.end - longest


def _merge_punctuation(timed: list[Timed]) -> None:
    """Opening punctuation joins the word after it, closing punctuation the word before (the
    emptied entries stay, empty, so that token counts still line up)."""
    following = len(timed) - 1
    for i in range(len(timed) - 2, -1, -1):
        word = timed[i]
        if word.word.startswith(" ") and word.word.strip() in PREPENDED:
            after = timed[following]
            after.word, after.tokens = word.word + after.word, word.tokens + after.tokens
            word.word, word.tokens = "", []
        else:
            following = i
    previous = 0
    for i in range(1, len(timed)):
        word, before = timed[i], timed[previous]
        if not before.word.endswith(" ") and word.word in APPENDED:
            before.word, before.tokens = before.word + word.word, before.tokens + word.tokens
            word.word, word.tokens = "", []
        else:
            previous = i


def place_words(
    segments: list[Segment],
    timed: list[Timed],
    end_of_text: int,
    offset: float,
    last_speech: float,
) -> tuple[list[Segment], float]:
    """The window's segments with their words (times from `offset`, the window's start), and
    the end of the last speech heard: each segment takes the words of its text's tokens; a
    first word after a pause, and a first or last word that strays half a second past its
    segment's times, are kept to them (openai-whisper's corrections)."""
    median = median_word_seconds(timed)
    longest = 2 * median
    placed: list[Segment] = []
    index = 0
    for segment in segments:
        count = sum(1 for t in segment.tokens if t < end_of_text)
        taken = 0
        words: list[Timed] = []
        while index < len(timed) and taken < count:
            word = timed[index]
            if word.word:
                words.append(Timed(word.word, word.tokens, offset + word.start, offset + word.end))
            taken += len(word.tokens)
            index += 1
        start, end = segment.start, segment.end
        if words:
            start, end = _keep_to_segment(words, start, end, median, longest, last_speech)
            last_speech = end
        placed.append(
            replace(
                segment,
                start=start,
                end=end,
                words=tuple(
                    Word(w.word.strip(), round(w.start, 2), round(w.end, 2)) for w in words
                ),
            )
        )
    return placed, last_speech


def _keep_to_segment(
    words: list[Timed],
    start: float,
    end: float,
    median: float,
    longest: float,
    last_speech: float,
) -> tuple[float, float]:
    first, last = words[0], words[-1]
    if first.end - last_speech > median * 4 and (
        first.end - first.start > longest
        or (len(words) > 1 and words[1].end - first.start > longest * 2)
    ):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            boundary = max(words[1].end / 2, words[1].end - longest)
            first.end = words[1].start = boundary
        first.start = max(0.0, first.end - longest)
    if start < first.end and start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, start))
    else:
        start = first.start
    if end > last.start and end + 0.5 < last.end:
        last.end = max(last.start + median, end)
    else:
        end = last.end
    return start, end
