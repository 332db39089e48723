"""Temperature fallback, as transformers' `generate()` does it for Whisper (openai-whisper's
`transcribe`): a window is decoded at the first temperature (0: greedy or beams), judged, and
decoded again at the next one while the judgement says so; the last attempt is kept whatever it
says.

An attempt fails when its tokens repeat themselves (their zlib compression ratio above a
threshold: generate() measures it on the token ids, so its threshold is 1.35 where
openai-whisper's 2.4 is on the text) or when it is unlikely (its average log-probability below a
threshold: a beam search's score, else the mean of its tokens' processed log-probabilities, the
end of text included). An unlikely attempt of a window that is probably silence (the probability
of `<|nospeech|>` after `<|startoftranscript|>` above a threshold) is not decoded again: the
window is skipped whole.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FallbackRules:
    temperatures: tuple[float, ...]  # one attempt each at most, in order
    compression_ratio_threshold: float
    logprob_threshold: float
    no_speech_threshold: float

    @classmethod
    def of(
        cls,
        temperature: float,
        increment: float,
        compression_ratio_threshold: float,
        logprob_threshold: float,
        no_speech_threshold: float,
    ) -> FallbackRules:
        """From `temperature` up to 1 by `increment` (0: `temperature` alone), as openai-whisper's
        `--temperature_increment_on_fallback` spells them."""
        temperatures = (
            tuple(round(float(t), 10) for t in np.arange(temperature, 1.0 + 1e-6, increment))
            if increment > 0
            else (temperature,)
        )
        return cls(
            temperatures, compression_ratio_threshold, logprob_threshold, no_speech_threshold
        )


@dataclass(frozen=True)
class Attempt:
    """One decode of a window: its tokens (the end of text included, when written), their
    processed log-probabilities, its beam score (beam search) and its temperature."""

    tokens: list[int]
    logprobs: list[float]
    beam_score: float | None
    temperature: float

    @property
    def avg_logprob(self) -> float:
        if self.beam_score is not None:
            return self.beam_score
        return sum(self.logprobs) / len(self.tokens) if self.tokens else 0.0


def compression_ratio(tokens: list[int], vocab_size: int) -> float:
    """The tokens' bytes (each in as few little-endian bytes as the vocabulary needs) over their
    zlib-compressed bytes."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(t.to_bytes(width, "little") for t in tokens)
    return len(data) / len(zlib.compress(data)) if data else 0.0


def fails(attempt: Attempt, rules: FallbackRules, vocab_size: int) -> bool:
    """Whether the attempt asks for the next temperature."""
    repeats = compression_ratio(attempt.tokens, vocab_size) > rules.compression_ratio_threshold
    return repeats or unlikely(attempt, rules)


def unlikely(attempt: Attempt, rules: FallbackRules) -> bool:
    """Below the log-probability threshold: with a high `<|nospeech|>` probability, silence."""
    return attempt.avg_logprob < rules.logprob_threshold


def silent(attempt: Attempt, rules: FallbackRules, no_speech_prob: float) -> bool:
    """Whether the window is skipped: an unlikely attempt where no speech is likely."""
    return unlikely(attempt, rules) and no_speech_prob > rules.no_speech_threshold
