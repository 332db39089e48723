"""A request inside the engine, its rows (sequences), and the outputs it streams back.

Requests and rows live in one module because each points at the other: a row knows its request
(the scheduler plans by request), a request lists its rows.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoding import (
    BeamSearch,
    DecodingParams,
    GroupBeamSearch,
    make_beam_search,
    ranked_tokens,
)
from decoding.constraints import TokenConstraint
from decoding.penalty_table import PenaltyRow
from decoding.random_streams import random_key, sibling_key, stream_key
from decoding.speculation import RowDrafts
from server.engine.detokenizer import IncrementalDetokenizer
from server.step_plan import NO_ADAPTER

_seq_ids = itertools.count()


class AdapterWeights(Protocol):
    """What the engine keeps of an adapter's weights (model/lora.py's LoRAAdapter)."""

    @property
    def name(self) -> str: ...

    @property
    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(A, B) of each projection it changes."""
        ...


@dataclass(frozen=True)
class ResolvedAdapter:
    """A request's adapter: its weights and the key its prefix-cache blocks are kept under."""

    name: str
    key: str  # name and load serial
    weights: AdapterWeights


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the raw model, and the top alternatives (prompt tokens
    also carry their rank: 1 + how many tokens the model found likelier)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x (one per row per step)
class RequestOutput:
    """A delta for one choice of a request: new text/tokens since the last output of that choice."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | no_legal_token | abort | error
    prompt_tokens: int
    completion_tokens: int  # total so far for this choice
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked for
    # with the request's first output, when asked for: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    beam_score: float | None = None  # beams: the hypothesis' score; diverse beams: its group too
    beam_group: int | None = None
    # a cross_attention request's: [alignment heads, decoder positions, source positions asked]
    cross_attention: torch.Tensor | None = None
    error: str | None = None
    request_done: bool = False  # the last output of the request: nothing follows

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merged(self, later: RequestOutput) -> RequestOutput | None:
        """This delta and the `later` one of the same choice as one delta, so that a consumer who
        fell behind sends one chunk (one write) for both; None when they cannot be one (another
        choice, an error, an ending before `later`, beam or prompt fields, logprobs that do not
        go one per token)."""
        if (
            later.index != self.index
            or self.finished
            or self.request_done
            or self.error is not None
            or later.error is not None
            or later.prompt_logprobs is not None
            or later.cross_attention is not None
            or self.beam_score is not None
            or later.beam_score is not None
            or not _one_per_token(self)
            or not _one_per_token(later)
        ):
            return None
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or []), *(later.logprobs or [])]
        return RequestOutput(
            request_id=self.request_id,
            index=self.index,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            completion_tokens=later.completion_tokens,
            cached_tokens=later.cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            request_done=later.request_done,
        )


def _one_per_token(out: RequestOutput) -> bool:
    return out.logprobs is None or len(out.logprobs) == len(out.token_ids)


@dataclass(eq=False)
class SequenceText:
    """Streaming text of one row: detokenizer, stop strings, what was already sent."""

    detok: IncrementalDetokenizer
    sent: int = 0  # characters of detok.text already emitted
    stop_checked: int = 0  # characters already searched for stop strings
    cut: bool = False  # a stop string ended the text: nothing after it may be flushed


@dataclass(eq=False)
class Sequence:
    """One row of a request: its tokens, progress through the KV cache, block table, outcome."""

    request: EngineRequest
    token_ids: list[int]
    prompt_len: int
    index: int = 0  # choice index within its request
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0  # tokens whose keys/values are in the cache
    block_table: list[int] = field(default_factory=list)
    # the block table as the model side holds it (None: not sent, or released there since)
    model_table: list[int] | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of full blocks
    retired: bool = False  # out of the batch (its ending may wait for its text: output_processor)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0  # raw-model log-likelihood of the output (best_of ranks by it)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when asked for
    text: SequenceText | None = None  # streaming rows only (see output_processor.py)
    constraint: TokenConstraint | None = None  # this row's own state (decoding/constraints.py)
    drafts: RowDrafts | None = None  # speculation's state (made at its first draft; forks anew)
    draft_computed: int = 0  # leading tokens a draft model's cache holds (engine/draft_model.py)
    # its slot of the engine's penalty table, made at its first penalized step and kept up to
    # date by every commit (decoding/penalty_table.py); None again when tokens are taken back
    penalties: PenaltyRow | None = None

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

    @property
    def lora_slot(self) -> int:
        """The device slot of its request's LoRA adapter (NO_ADAPTER: the base model)."""
        return self.request.lora_slot

    def release_penalties(self) -> None:
        """Give its penalty table row back (made anew at its next penalized step)."""
        if self.penalties is not None:
            self.penalties.release()
            self.penalties = None

    @property
    def stream_key(self) -> int:
        """Its random stream's key: its output token i draws number i of it."""
        return sibling_key(self.request.stream_key, self.index)


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: DecodingParams
    emit: Callable[[RequestOutput], None]  # must be thread-safe: called from the engine thread
    trace_id: str | None = None  # the client's X-Request-Id, for logs
    constraint: TokenConstraint | None = None  # the first row's state; rows fork their own
    arrival_time: float = field(default_factory=time.monotonic)
    # its first row's random stream (decoding/random_streams.py): from its seed, else drawn at
    # admission; its other rows (n, best_of) derive theirs from it
    stream_key: int = 0
    rows: list[Sequence] = field(default_factory=list)  # active rows, in sibling order
    done_rows: list[Sequence] = field(default_factory=list)  # finished rows (best_of ranks them)
    search: BeamSearch | GroupBeamSearch | None = None
    # per step, the logprob of each (input row, token) its beam search chose (see beams.py)
    beam_logprobs: list[dict[tuple[int, int], TokenLogprob]] = field(default_factory=list)
    finishing_ids: frozenset[int] = frozenset()  # stop_token_ids, plus EOS unless ignore_eos
    # how many likeliest tokens its choice reads (decoding.ranked_tokens; 0: all of them)
    ranked_tokens: int = 0
    # it asks for its tokens' logprobs: its rows' logits come from an int8 LM head's
    # floating-point weight whole (quantization.head_logits)
    returns_logprobs: bool = False
    # prompt logprobs, when asked for: one per prompt token scored so far (the first is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # cross_attention: its decoder positions' scores as computed so far (prompt_scoring.py)
    cross_attention: torch.Tensor | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache when it was first scheduled
    finished: bool = False
    # the model the client's `model` names when not the served one: a LoRA adapter, or an extra
    # model (then `model`, once admitted: the extra model that runs its rows; engine/fusion.py)
    model_name: str | None = None
    model: str | None = None
    adapter: ResolvedAdapter | None = None  # its weights, once admitted (engine._drain_inbox)
    lora_slot: int = NO_ADAPTER  # the device slot its adapter occupies while it runs
    # an encoder-decoder request: its prompt is the source's ids, then the decoder's first
    # (model/seq2seq/runner.py); 0 for a decoder-only model
    source_len: int = 0
    # an audio source's log-mel features (Whisper): its source ids are placeholders
    source_features: torch.Tensor | None = None

    def prepare(self, eos_ids: frozenset[int], device: torch.device, max_model_len: int) -> None:
        """Admission: the ids that end it, its random stream, its beam search, its first row
        (which takes over the request's constraint state)."""
        params = self.params
        self.finishing_ids = params.finishing_ids(eos_ids)
        ranked = ranked_tokens(params)
        self.ranked_tokens = 0 if ranked is None or self.constraint is not None else ranked
        self.returns_logprobs = params.logprobs is not None
        self.stream_key = stream_key(params.seed) if params.seed is not None else random_key()
        if params.is_beam:
            room = max_model_len - len(self.prompt_ids)
            self.search = make_beam_search(params, eos_ids, max_new_tokens=room)
        first = Sequence(self, list(self.prompt_ids), len(self.prompt_ids))
        first.constraint, self.constraint = self.constraint, None
        self.rows.append(first)

    @property
    def num_prompt_tokens(self) -> int:
        """What its usage counts as prompt: an encoder-decoder request's source."""
        return self.source_len or len(self.prompt_ids)

    @property
    def decoder_prompt_ids(self) -> list[int]:
        """The prompt the decoder reads (the whole prompt of a decoder-only model): what
        penalties and n-gram bans look back on, as `generate()` does on decoder_input_ids."""
        return self.prompt_ids[self.source_len :] if self.source_len else self.prompt_ids

    @property
    def width(self) -> int:
        """Rows this request occupies once its prompt is prefilled."""
        return self.params.width

    @property
    def priority(self) -> int:
        """Its place in the waiting queue: lowest first (scheduler.enqueue)."""
        return self.params.priority

    @property
    def cache_salt(self) -> str | None:
        """Prefix-cache blocks are shared only with requests of the same salt (prefix_cache.py)."""
        return self.params.cache_salt

    @property
    def adapter_key(self) -> str | None:
        """Prefix-cache blocks are shared only with requests of the same adapter (and load)."""
        return self.adapter.key if self.adapter is not None else None

    @property
    def companion(self) -> str | None:
        """The model fused into its steps (lm_fusion): its rows' blocks hold that model's keys and
        values too, shared in the prefix cache only under the same companion."""
        fusion = self.params.lm_fusion
        return fusion.model if fusion is not None else None

    @property
    def scores_prompt(self) -> bool:
        """It asks for its prompt's logprobs: its prompt runs at full precision under an int8
        format (model/exact_weights.py), and shares prefix-cache blocks only with such requests."""
        return self.params.prompt_logprobs is not None

    @property
    def cache_limit(self) -> int | None:
        """The prompt positions the prefix cache may serve, at most (None: all): a cached block
        holds keys and values, no logits and no attention scores."""
        if self.params.cross_attention:
            return self.source_len
        return self.unscored_from

    @property
    def unscored_from(self) -> int | None:
        """The first prompt position whose hidden state prompt logprobs still need (its logits
        score the token after it); None when nothing is left to score. Tokens before it may come
        from the prefix cache, later ones must be computed."""
        scored = self.prompt_logprobs
        if scored is None or len(scored) >= len(self.prompt_ids):
            return None
        return len(scored) - 1

    @property
    def streams(self) -> bool:
        """Sampled strategies stream per choice; beams and best_of know their answer at the end."""
        return self.search is None and self.params.strategy != "best_of"
