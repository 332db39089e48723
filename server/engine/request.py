"""A request inside the engine, its rows, and the outputs it streams back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoding import BeamSearch, DecodingParams, GroupBeamSearch
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the raw model, and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class RequestOutput:
    """A delta for one choice of a request: new text/tokens since the last output of that choice."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int  # total so far for this choice
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    error: str | None = None
    request_done: bool = False  # the last output of the request: nothing follows

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class SequenceText:
    """Streaming text of one row: detokenizer, stop strings, what was already sent."""

    detok: IncrementalDetokenizer
    sent: int = 0  # characters of detok.text already emitted
    stop_checked: int = 0  # characters already searched for stop strings
    cut: bool = False  # a stop string ended the text: nothing after it may be flushed


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    emit: Callable[[RequestOutput], None]  # must be thread-safe: called from the engine thread
    trace_id: str | None = None  # the client's X-Request-Id, for logs
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    rows: list[Sequence] = field(default_factory=list)  # active rows, in sibling order
    done_rows: list[Sequence] = field(default_factory=list)  # finished rows (best_of ranks them)
    search: BeamSearch | GroupBeamSearch | None = None
    beam_logprobs: dict[tuple[int, ...], TokenLogprob] | None = None
    finishing_ids: frozenset[int] = frozenset()  # stop_token_ids, plus EOS unless ignore_eos
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache when it was first scheduled
    finished: bool = False

    @property
    def width(self) -> int:
        """Rows this request occupies once its prompt is prefilled."""
        return self.params.width

    @property
    def streams(self) -> bool:
        """Sampled strategies stream per choice; beams and best_of only know their answer at the end."""
        return self.search is None and self.params.strategy != "best_of"
