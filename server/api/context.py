"""What every request handler needs of the running server: engine, tokenizer, limits, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

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
    grammars: GrammarService = field(init=False)  # structured outputs' compiles and cache

    def __post_init__(self) -> None:
        self.grammars = GrammarService(
            self.tokenizer,
            self.vocab_size,
            self.engine.eos_token_ids,
            cache_size=self.config.grammar_cache_size,
            timeout_s=self.config.grammar_compile_timeout,
            metrics=self.metrics,
        )
