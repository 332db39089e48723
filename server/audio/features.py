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


def window_features(extractor: WhisperFeatureExtractor, samples: np.ndarray) -> torch.Tensor:
    """The log-mel features [mel bins, 3000] of up to 30 seconds of samples (padded with
    silence to the window, as `generate()`'s short-form input is)."""
    features = extractor(
        samples,
        sampling_rate=extractor.sampling_rate,
        return_tensors="pt",
        padding="max_length",
        truncation=True,
    ).input_features
    return features[0]


def window_seconds(extractor: WhisperFeatureExtractor) -> float:
    """The seconds one window holds (30)."""
    return float(extractor.n_samples) / float(extractor.sampling_rate)
