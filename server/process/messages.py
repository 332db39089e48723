"""What crosses the pipe between the front end and the engine process (pickled by
multiprocessing.connection). One Outputs message per engine step carries every output of the step,
the metric calls the engine made (metrics_relay.py) and its counters, so the front end's
/metrics and /v1/engine/stats are never behind the outputs its clients saw."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding import DecodingParams
from decoding.grammar import GrammarSpec
from server.engine.request import RequestOutput

MetricEvent = tuple[str, tuple[object, ...], dict[str, object]]  # method, args, kwargs


# ---- front end -> engine ----------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    trace_id: str | None = None  # the client's X-Request-Id, for the engine's log lines
    grammar: GrammarSpec | None = None  # compiled again (and cached) in the engine process
    model: str | None = None  # a LoRA adapter's or an extra model's name (its `model`)
    source_len: int = 0  # an encoder-decoder model's source: the prompt's first ids
    source_features: torch.Tensor | None = None  # a speech model's audio (its source's)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class LoadAdapter:
    call_id: int
    name: str
    source: str


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


@dataclass(frozen=True)
class Shutdown:
    pass


# ---- engine -> front end ----------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterLoaded:
    """The answer to LoadAdapter: None, or why the adapter was not loaded."""

    call_id: int
    error: str | None


@dataclass(frozen=True)
class Ready:
    """Loaded and warmed up: what the front end needs to know of the engine."""

    adapters: dict[str, str]  # the LoRA adapters served from start-up: name -> source
    max_model_len: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    block_size: int
    vocab_size: int
    stats: dict[str, int | float | bool | str]
    metric_events: list[MetricEvent] = field(default_factory=list)


@dataclass(frozen=True)
class StartupFailed:
    message: str


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]
    metric_events: list[MetricEvent]
    stats: dict[str, int | float | bool | str]
    adapter_replies: list[AdapterLoaded] = field(default_factory=list)


@dataclass(frozen=True)
class Died:
    """The engine loop broke; every request it held was failed in the Outputs before this."""

    message: str
