"""What every request handler needs of the running server: engine, tokenizer, limits, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from server.api.encoder_decoder import SourceModel
from server.api.named_models import NamedModel
from server.audio.speech_model import SpeechModel
from server.config import ServerConfig
from server.engine.client import EngineClient
from server.grammars import GrammarService
from server.metrics import Metrics


@dataclass
class ServingContext:
    engine: EngineClient
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    max_model_len: int
    vocab_size: int
    config: ServerConfig
    metrics: Metrics | None = None
    # the sampling fields the model's generation_config.json sets (sampling_defaults.py)
    model_sampling_defaults: dict[str, Any] = field(default_factory=dict)
    encoder_decoder: SourceModel | None = None  # an encoder-decoder model's (None: decoder-only)
    speech: SpeechModel | None = None  # a speech model's (Whisper): the audio routes serve it
    grammar_token_bytes: Path | None = None  # where the grammar engine's vocabulary is kept
    # the extra models requests may fuse (lm_fusion), each with why it cannot be (None: it can)
    fusion_models: dict[str, str | None] = field(default_factory=dict)
    # the extra models a request's `model` may name, each with why it cannot (None: it can)
    named_models: dict[str, NamedModel] = field(default_factory=dict)
    grammars: GrammarService = field(init=False)  # structured outputs' compiles and cache

    def __post_init__(self) -> None:
        self.grammars = GrammarService(
            self.tokenizer,
            self.vocab_size,
            self.engine.eos_token_ids,
            cache_size=self.config.grammar_cache_size,
            timeout_s=self.config.grammar_compile_timeout,
            metrics=self.metrics,
            token_bytes_path=self.grammar_token_bytes,
        )

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults that apply to fields a request leaves unset: all of
        them, or none when the server is told not to (`generation_config_defaults` false)."""
        return self.model_sampling_defaults if self.config.generation_config_defaults else {}

    def sampling_defaults_of(self, model: str | None) -> dict[str, Any]:
        """`sampling_defaults` of the model a request's `model` names (an extra model's own;
        the served model's for itself, its adapters and None)."""
        named = self.named_models.get(model) if model is not None else None
        if named is None or not self.config.generation_config_defaults:
            return self.sampling_defaults
        return named.sampling_defaults
