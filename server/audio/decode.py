"""Audio uploads decoded to 16 kHz mono float samples, by PyAV (FFmpeg's libraries, bundled in
its wheels).

PyAV rather than soundfile: libsndfile reads wav, flac, ogg and mp3 but not m4a (AAC) or webm
(Opus in Matroska), which OpenAI's transcription route accepts and browsers record; FFmpeg reads
them all, and its resampler converts any rate and channel layout in the same pass.
faster-whisper decodes with PyAV as well, so the two hear the same samples.

Whatever FFmpeg cannot read as audio (not audio, truncated, no audio stream) and audio with no
samples are `AudioError`s, which the front end answers with a 400; audio longer than the limit
stops decoding as soon as it is past it.
"""

from __future__ import annotations

import io

import numpy as np

SAMPLING_RATE = 16_000  # Whisper's


class AudioError(ValueError):
    """The upload cannot be transcribed: the message says why (one line)."""


def decode_audio(data: bytes, max_seconds: float, rate: int = SAMPLING_RATE) -> np.ndarray:
    """`data` (any container and codec FFmpeg reads) as mono float32 samples at `rate`."""
    import av

    if not data:
        raise AudioError("the file is empty")
    limit = int(max_seconds * rate)
    chunks: list[np.ndarray] = []
    count = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise AudioError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(audio=0):
                for part in resampler.resample(frame):
                    chunks.append(part.to_ndarray().reshape(-1))
                    count += chunks[-1].shape[0]
                if count > limit:
                    raise AudioError(too_long(max_seconds))
            for part in resampler.resample(None):  # what the resampler still holds
                chunks.append(part.to_ndarray().reshape(-1))
                count += chunks[-1].shape[0]
    except av.FFmpegError as exc:
        raise AudioError(f"the file could not be read as audio ({exc})") from exc
    if count > limit:
        raise AudioError(too_long(max_seconds))
    if count == 0:
        raise AudioError("the file holds no audio samples")
    return np.concatenate(chunks).astype(np.float32, copy=False)


def too_long(max_seconds: float) -> str:
    return f"the audio is longer than this server's limit of {max_seconds:g} seconds"
