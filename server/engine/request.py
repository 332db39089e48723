"""A request inside the engine and the outputs it streams back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding import DecodingParams
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sequence import Sequence


@dataclass(frozen=True)
class RequestOutput:
    """A delta for one choice of a request: new text/tokens since the last output."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int  # total so far for this choice
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    emit: Callable[[RequestOutput], None]  # must be thread-safe: called from the engine thread
    trace_id: str | None = None  # the client's X-Request-Id, for logs
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(eq=False)
class SequenceText:
    """Text bookkeeping of one sequence: detokenizer, stop strings, what was already sent."""

    detok: IncrementalDetokenizer
    sent: int = 0  # characters of detok.text already emitted
    stop_checked: int = 0  # characters already searched for stop strings
