"""A window's timestamped tokens split into segments, as openai-whisper reads them: a timestamp
opens a segment and the next one closes it (two in a row: one segment ends where the next
begins); text after the last opening timestamp, where the decode stopped before closing it, ends
with the audio."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TIME_PRECISION = 0.02  # seconds per timestamp token: 30 s over 1,500 positions


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    tokens: list[int]  # its text's tokens and its timestamps
    text: str
    logprobs: list[float]  # of its tokens, where they were asked for


def split_segments(
    tokens: list[int],
    logprobs: list[float],
    timestamp_begin: int,
    end_of_text: int,
    duration: float,
    decode: Callable[[list[int]], str],
) -> list[Segment]:
    segments: list[Segment] = []
    start: float | None = None
    last = 0.0  # the latest timestamp: where text after a closing one (no opening) starts
    held: list[int] = []
    held_logprobs: list[float] = []

    def close(end: float) -> None:
        text = decode([t for t in held if t < timestamp_begin])
        if text.strip():
            begin = last if start is None else start
            segments.append(Segment(begin, end, list(held), text, list(held_logprobs)))
        held.clear()
        held_logprobs.clear()

    for index, token in enumerate(tokens):
        if token == end_of_text:
            break
        held.append(token)
        if index < len(logprobs):
            held_logprobs.append(logprobs[index])
        if token < timestamp_begin:
            continue
        time = (token - timestamp_begin) * TIME_PRECISION
        last = time
        if start is None:
            start = time
            continue
        close(time)
        start = None
    if held:
        close(max(duration, last))
    return segments
