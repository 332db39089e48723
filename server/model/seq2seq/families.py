"""Which parts class serves a loaded encoder-decoder model, by its family."""

from __future__ import annotations

from torch import nn

from server.model.seq2seq.decoder import Seq2SeqParts
from server.model.seq2seq.t5 import T5_FAMILIES, T5Parts
from server.model.seq2seq.whisper import WhisperParts


def parts_of(model: nn.Module, model_type: str) -> Seq2SeqParts:
    """The parts of a loaded encoder-decoder model, by its family."""
    if model_type in T5_FAMILIES:
        return T5Parts(model, model_type)
    if model_type == "whisper":
        return WhisperParts(model, model_type)
    return Seq2SeqParts(model, model_type)
