"""Audio for the speech tests: speech synthesized by espeak-ng, and samples encoded into the
containers an upload may come in (PyAV's encoders: no ffmpeg binary needed)."""

from __future__ import annotations

import io
import os

import av
import numpy as np
import pytest

from benchmarks import speech_clips

# (container format, codec, codec rate): what browsers and phones record, and the classics
CONTAINERS = {
    "wav": ("wav", "pcm_s16le", None),
    "flac": ("flac", "flac", None),
    "mp3": ("mp3", "libmp3lame", None),
    "ogg": ("ogg", "libopus", 48_000),
    "m4a": ("ipod", "aac", None),
    "webm": ("webm", "libopus", 48_000),
}


def encode(samples: np.ndarray, kind: str, rate: int = 16_000) -> bytes:
    """Mono float `samples` at `rate` as a file of `kind` (a CONTAINERS key)."""
    container_format, codec, codec_rate = CONTAINERS[kind]
    out = io.BytesIO()
    with av.open(out, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=codec_rate or rate, layout="mono")
        pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
        for start in range(0, len(pcm), 1024):
            frame = av.AudioFrame.from_ndarray(
                pcm[None, start : start + 1024], format="s16", layout="mono"
            )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def tone(seconds: float, rate: int = 16_000, seed: int = 0) -> np.ndarray:
    """A chord with a little noise: audio a random model hears as something."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).normal(0, 0.05, t.shape)
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 660 * t) + noise).astype(
        np.float32
    )


def espeak_wav(text: str, words_per_minute: int = 150, voice: str = "en-us") -> bytes:
    """`text` spoken by espeak-ng (benchmarks/speech_clips.py); CI fails without it, elsewhere the
    test skips."""
    try:
        return speech_clips.espeak_wav(text, words_per_minute, voice)
    except speech_clips.EspeakMissing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
