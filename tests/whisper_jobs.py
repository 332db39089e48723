"""Submit Whisper windows to a test engine as the front end does (server/audio/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from decoding import DecodingParams
from server.audio.speech_model import SpeechModel, window_salt
from server.engine.engine import Engine
from server.engine.request import EngineRequest
from tests.engine_driver import Collected


def speech_model(model_dir: Path) -> SpeechModel:
    model = SpeechModel.read(model_dir, AutoTokenizer.from_pretrained(model_dir))
    assert model is not None
    return model


def window_params(model_dir: Path, **fields: Any) -> DecodingParams:
    """The generation config's defaults, then `fields`."""
    return DecodingParams(**{**speech_model(model_dir).defaults(), **fields})


def submit_window(
    engine: Engine,
    model_dir: Path,
    request_id: str,
    features: torch.Tensor,
    params: DecodingParams,
    language: str | None = None,
    timestamps: bool = False,
) -> Collected:
    model = speech_model(model_dir)
    prompt = model.engine_prompt(model.decoder_prompt(language, timestamps=timestamps))
    if timestamps:
        params = dataclasses.replace(params, timestamp_rules=model.timestamp_rules())
    params = dataclasses.replace(params, cache_salt=window_salt(features, params.cache_salt))
    got = Collected()
    request = EngineRequest(
        request_id,
        prompt,
        params,
        got.outputs.append,
        source_len=model.source_positions,
        source_features=features,
    )
    engine.submit(request)
    return got
