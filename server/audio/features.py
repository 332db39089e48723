"""Whisper's input: the log-mel spectrogram of a 30-second window, by transformers'
`WhisperFeatureExtractor` (its torch path: one short-time Fourier transform of the whole signal
and a matrix product with the mel filters, no loop over frames), configured by the model's
`preprocessor_config.json` (80 mel bins, or 128 for large-v3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import WhisperFeatureExtractor


def feature_extractor(model_dir: Path, mel_bins: int) -> WhisperFeatureExtractor:
    """The model's feature extractor (Whisper's defaults with its mel bins when it has none)."""
    if (model_dir / "preprocessor_config.json").is_file():
        return WhisperFeatureExtractor.from_pretrained(model_dir, local_files_only=True)
    return WhisperFeatureExtractor(feature_size=mel_bins)


def audio_features(
    extractor: WhisperFeatureExtractor, samples: np.ndarray
) -> tuple[torch.Tensor, bool]:
    """The log-mel features [mel bins, frames] `generate()` decodes `samples` from, and whether
    they are long-form: up to one window, that window padded with silence (3,000 frames, as
    `generate()`'s short-form input is); past it, the whole audio's frames (its windows are cut
    from them: audio/windows.py)."""
    long = samples.shape[0] > extractor.n_samples
    features = extractor(
        samples,
        sampling_rate=extractor.sampling_rate,
        return_tensors="pt",
        padding="longest" if long else "max_length",
        truncation=not long,
    ).input_features
    return features[0], long
