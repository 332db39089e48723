"""What every request handler needs of the running server: engine, tokenizer, limits, metrics."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from server.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.metrics import Metrics


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    max_model_len: int
    vocab_size: int
    config: ServerConfig
    metrics: Metrics | None = None
