"""Per-sequence state: tokens, progress through the KV cache, block table, finish reason."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.engine.request import EngineRequest

_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]
    prompt_len: int
    index: int = 0  # choice index within its request
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0  # tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of full blocks
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0  # raw-model log-likelihood of the output (best_of ranks by it)
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when asked for

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before this sequence can sample again."""
        return len(self.token_ids) - self.num_computed
