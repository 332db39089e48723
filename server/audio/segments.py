"""A transcript's segments: the spans of its windows (windows.py) with their text."""

from __future__ import annotations

from dataclasses import dataclass

TIME_PRECISION = 0.02  # seconds per timestamp token: 30 s over 1,500 positions


@dataclass(frozen=True)
class Word:
    """A word heard and its times in the audio (alignment.py)."""

    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    tokens: list[int]  # its text's tokens and its timestamps
    text: str
    logprobs: list[float]  # of its tokens (processed: generate()'s fallback averages them)
    temperature: float = 0.0  # of the window's kept attempt
    no_speech_prob: float | None = None  # of its window, where it was measured
    seek: int = 0  # its window's first feature frame (100 a second)
    words: tuple[Word, ...] = ()  # with word timestamps
