"""Audio of any length as a sequence of 30-second windows, as transformers' `generate()` decodes
it (openai-whisper's `transcribe`): the window at `seek` (in feature frames, 100 a second) is
decoded; its timestamped tokens give its segments and how far to seek for the next one. A
window whose last segment closed with one timestamp (or that wrote none) is done whole; else the
next window starts at its last closed segment's end, so that speech cut by the window's edge is
heard again whole. Short audio is the same loop over one padded window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.audio.segments import TIME_PRECISION

WINDOW_FRAMES = 3000  # feature frames of one window (30 s)
INPUT_STRIDE = 2  # feature frames per encoder position (and per timestamp step)
FRAME_SECONDS = 0.01


@dataclass(frozen=True)
class Span:
    """A segment `generate()` keeps: its tokens (text and timestamps), its times in the audio."""

    start: float
    end: float
    tokens: list[int]


def window_input(features: torch.Tensor, seek: int) -> tuple[torch.Tensor, int]:
    """The window's features [mel bins, 3000] at frame `seek` (zeros past the audio's end) and
    how many of its frames are audio."""
    part = features[:, seek : seek + WINDOW_FRAMES]
    frames = part.shape[-1]
    if frames < WINDOW_FRAMES:
        part = torch.nn.functional.pad(part, (0, WINDOW_FRAMES - frames))
    return part, frames


def window_spans(
    tokens: list[int], timestamp_begin: int, seek: int, frames: int
) -> tuple[list[Span], int]:
    """The segments a window's tokens (its end of text taken off) keep, and the frames to seek."""
    offset = seek * FRAME_SECONDS
    stamps = [token >= timestamp_begin for token in tokens]
    single_ending = stamps[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(stamps) - 1) if stamps[i] and stamps[i + 1]]
    if not cuts:  # no pair of timestamps: the window is one segment, done whole
        positions = [i for i, is_stamp in enumerate(stamps) if is_stamp]
        last = frames * FRAME_SECONDS / TIME_PRECISION
        if positions and tokens[positions[-1]] != timestamp_begin:
            last = tokens[positions[-1]] - timestamp_begin
        return [Span(offset, offset + last * TIME_PRECISION, list(tokens))], frames
    if single_ending:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1
    spans = []
    previous = 0
    for index, cut in enumerate(cuts):
        part = tokens[previous:cut]
        closing = -1 if index < len(cuts) - 1 or single_ending else -2
        start = offset + (part[0] - timestamp_begin) * TIME_PRECISION
        spans.append(Span(start, offset + (part[closing] - timestamp_begin) * TIME_PRECISION, part))
        previous = cut
    if single_ending:
        return spans, frames
    return spans, (tokens[previous - 2] - timestamp_begin) * INPUT_STRIDE
