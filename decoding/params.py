"""One validated object per request holding every decoding parameter.

Names follow the OpenAI API where it has the parameter, Hugging Face `generate()` otherwise, so a
`DecodingParamsError.field` can be handed back to the client as the offending `param`.

Strategy rules (`DecodingParams.strategy`), first match wins:
1. `num_beams > 1` and `num_beam_groups > 1`  -> "group_beam" (never samples).
2. `num_beams > 1` and `do_sample is True`      -> "beam_sample".
3. `num_beams > 1`                              -> "beam". Beams sample only when asked with
   `do_sample=True`: the OpenAI default `temperature=1.0` must not silently turn every beam
   request into beam sampling (HF's beam search is deterministic by default too).
4. `best_of > n`                                -> "best_of" (sample best_of, return the best n).
5. otherwise "sample" when sampling, else "greedy". Sampling is `do_sample` when given, else
   `temperature > 0`; `top_k == 1` always collapses to greedy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from decoding.fusion import LMFusion
from decoding.param_checks import (
    DecodingParamsError,
    check,
    check_int,
    check_token_fields,
    finite,
    normalise_bad_words,
    parse_logit_bias,
)
from decoding.timestamps import TimestampRules

Strategy = Literal["greedy", "sample", "beam", "group_beam", "beam_sample", "best_of"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
EarlyStopping = bool | Literal["never"]
# raw: the model's log-probabilities; processed: log_softmax of the scores the token was chosen
# from (processors and truncation warpers applied) with the temperature undone, what generate()'s
# Whisper fallback averages (beam rows: their beam scores are processed already)
LogprobsMode = Literal["raw", "processed"]

BEAM_STRATEGIES: frozenset[str] = frozenset({"beam", "group_beam", "beam_sample"})
PENALTY_LIMIT = 2.0  # OpenAI's range for presence/frequency penalties


@dataclass(frozen=True)
class DecodingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # --- processors (HF generate() order; see decoding/processors.py) ---
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # --- strategy ---
    best_of: int | None = None
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    do_sample: bool | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    logprobs_mode: LogprobsMode = "raw"
    prompt_logprobs: int | None = None  # the same for every prompt token (scored in prefill)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be chosen, EOS included
    # --- the output's text and the request's place in the engine (vLLM's fields) ---
    include_stop_str_in_output: bool = False  # the stop string (or stop id's text) ends the text
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # slow tokenizers only (fast ones have no such)
    priority: int = 0  # waiting requests start lowest first, then by arrival
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    # generate()'s forced tokens (an encoder-decoder model's generation config, or its target
    # language): the first output token, and the last one max_tokens allows
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] = ()
    # generate()'s begin_suppress_tokens (Whisper): never the first output token, EOS included
    begin_suppress_tokens: tuple[int, ...] = ()
    timestamp_rules: TimestampRules | None = None  # Whisper's, with timestamps (timestamps.py)
    # above 0: an encoder-decoder prompt that generates nothing (max_tokens 0) returns its
    # decoder positions' cross-attention scores at the model's alignment heads over its first
    # this many source positions (Whisper's word times: a window's audio)
    cross_attention: int = 0
    lm_fusion: LMFusion | None = None  # a second model's log-probs added every step (fusion.py)

    def __post_init__(self) -> None:
        # Normalise container types so equal requests compare equal (lists from JSON, str keys).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "forced_eos_token_ids", tuple(self.forced_eos_token_ids))
        object.__setattr__(self, "begin_suppress_tokens", tuple(self.begin_suppress_tokens))
        object.__setattr__(self, "bad_words_ids", normalise_bad_words(self.bad_words_ids))
        object.__setattr__(self, "logit_bias", parse_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self._check_values()
        self._check_combinations()

    # ---- validation -----------------------------------------------------------------------------
    def _check_values(self) -> None:
        check_int(self.max_tokens, "max_tokens", low=0)  # 0: only score the prompt
        check(
            finite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            "temperature must be >= 0",
        )
        check_int(self.top_k, "top_k", low=-1, hint="top_k must be >= 0 (0 or -1 disables it)")
        check(finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        check(finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        check(
            finite(self.typical_p) and 0.0 < self.typical_p <= 1.0,
            "typical_p",
            "typical_p must be in (0, 1]",
        )
        check(
            finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            "repetition_penalty must be > 0 (1 disables it)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(
                finite(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT,
                name,
                f"{name} must be in [-2, 2]",
            )
        check_int(self.no_repeat_ngram_size, "no_repeat_ngram_size", low=0)
        if self.forced_bos_token_id is not None:
            check_int(self.forced_bos_token_id, "forced_bos_token_id", low=0)
        for token in self.forced_eos_token_ids:
            check_int(token, "forced_eos_token_ids", low=0)
        for token in self.begin_suppress_tokens:
            check_int(token, "begin_suppress_tokens", low=0)
        check_int(self.min_tokens, "min_tokens", low=0)
        check_int(self.n, "n", low=1)
        if self.best_of is not None:
            check_int(self.best_of, "best_of", low=1)
        check_int(self.num_beams, "num_beams", low=1)
        check_int(self.num_beam_groups, "num_beam_groups", low=1)
        check(
            finite(self.diversity_penalty) and self.diversity_penalty >= 0.0,
            "diversity_penalty",
            "diversity_penalty must be >= 0",
        )
        check(
            finite(self.length_penalty), "length_penalty", "length_penalty must be a finite number"
        )
        check(
            isinstance(self.early_stopping, bool) or self.early_stopping == "never",
            "early_stopping",
            'early_stopping must be true, false or "never"',
        )
        check(
            self.do_sample is None or isinstance(self.do_sample, bool),
            "do_sample",
            "do_sample must be a boolean",
        )
        if self.logprobs is not None:
            check_int(self.logprobs, "logprobs", low=0)
        if self.prompt_logprobs is not None:
            check_int(self.prompt_logprobs, "prompt_logprobs", low=0)
        if self.seed is not None:
            check(
                isinstance(self.seed, int) and not isinstance(self.seed, bool),
                "seed",
                "seed must be an integer",
            )
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must not be empty",
        )
        check_token_fields(
            self.stop_token_ids, self.logit_bias, self.bad_words_ids, self.allowed_token_ids
        )
        check(
            self.logprobs_mode in get_args(LogprobsMode),
            "logprobs_mode",
            'logprobs_mode must be "raw" or "processed"',
        )
        check(
            isinstance(self.priority, int) and not isinstance(self.priority, bool),
            "priority",
            "priority must be an integer",
        )
        check(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and bool(self.cache_salt)),
            "cache_salt",
            "cache_salt must be a non-empty string",
        )

    def _check_combinations(self) -> None:
        if self.do_sample is True and self.temperature == 0.0:
            raise DecodingParamsError("temperature", "do_sample=true needs temperature > 0")
        if self.min_tokens > self.max_tokens:
            raise DecodingParamsError("min_tokens", "min_tokens must not exceed max_tokens")
        if self.max_tokens == 0 and self.width > 1:
            raise DecodingParamsError(
                "max_tokens",
                "max_tokens 0 (score the prompt, generate nothing) needs a single row: "
                "n = 1, no best_of, no beams",
            )
        check_int(self.cross_attention, "cross_attention", low=0)
        if self.cross_attention and self.max_tokens:
            raise DecodingParamsError("cross_attention", "cross_attention needs max_tokens 0")
        if self.lm_fusion is not None and self.prompt_logprobs is not None:
            raise DecodingParamsError(  # the prompt is scored by the main model alone
                "prompt_logprobs", "prompt logprobs cannot be combined with lm_fusion"
            )
        if self.num_beam_groups > 1:
            if self.num_beams == 1:
                raise DecodingParamsError(
                    "num_beam_groups", "num_beam_groups > 1 needs num_beams > 1"
                )
            if self.num_beams % self.num_beam_groups:
                raise DecodingParamsError(
                    "num_beam_groups", "num_beams must be divisible by num_beam_groups"
                )
            if self.do_sample:
                raise DecodingParamsError(
                    "do_sample", "group beam search cannot sample (do_sample=true)"
                )
        if self.diversity_penalty and self.num_beam_groups == 1:
            raise DecodingParamsError(
                "diversity_penalty", "diversity_penalty needs num_beam_groups > 1"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise DecodingParamsError("best_of", "best_of must be >= n")
        if self.num_beams > 1:
            if self.n > self.num_beams:
                raise DecodingParamsError("n", "n (sequences returned) must be <= num_beams")
            if self.best_of is not None and self.best_of > self.n:
                raise DecodingParamsError("best_of", "best_of cannot be combined with beam search")
        elif self.best_of is not None and self.best_of > self.n and not self.sampling:
            raise DecodingParamsError("best_of", "best_of > n needs sampling (temperature > 0)")

    # ---- derived properties ---------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        """Whether tokens (or beam candidates) are drawn at random; see the module docstring."""
        if self.num_beams > 1:
            return self.do_sample is True and self.num_beam_groups == 1
        if self.top_k == 1:
            return False
        return self.do_sample if self.do_sample is not None else self.temperature > 0.0

    @property
    def greedy(self) -> bool:
        """No randomness and no warpers: argmax rows, and plain or group beam search."""
        return not self.sampling

    @property
    def strategy(self) -> Strategy:
        if self.num_beams > 1:
            if self.num_beam_groups > 1:
                return "group_beam"
            return "beam_sample" if self.sampling else "beam"
        if self.best_of is not None and self.best_of > self.n:
            return "best_of"
        return "sample" if self.sampling else "greedy"

    @property
    def is_beam(self) -> bool:
        return self.num_beams > 1

    @property
    def width(self) -> int:
        """Rows the request occupies in a decode step once its prompt is prefilled."""
        return request_width(self.n, self.best_of, self.num_beams)

    def finishing_ids(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """Token ids that end a sequence: `stop_token_ids` plus the model's EOS unless ignored."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_ids)
        return frozenset(ids)


def request_width(n: int, best_of: int | None, num_beams: int) -> int:
    """`DecodingParams.width` from its three fields, for a front end that needs it before the
    request's parameters are complete (its default max_tokens depends on the width)."""
    return num_beams if num_beams > 1 else max(n, best_of or 0)


def ranked_tokens(params: DecodingParams) -> int | None:
    """How many of a row's likeliest tokens its choice and its returned logprobs depend on:
    1 greedy, 2 x num_beams for beam search (a step keeps each request's best 2 x beams
    candidates, as `generate()` does), `top_k` for top-k sampling, at least `logprobs`.
    None where the whole distribution counts (sampling without top-k, beam sampling, group
    beams' diversity penalty) or a processor changes logits' values (penalties, logit bias, an
    allow-list). Bans (min_tokens' EOS, bad words, repeated n-grams) only drop tokens."""
    changes_values = (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
        or params.allowed_token_ids is not None
        or params.lm_fusion is not None  # a companion's scores may lift any token
    )
    if changes_values or params.num_beam_groups > 1:
        return None
    if params.sampling:
        if params.top_k <= 0:
            return None
        ranked = params.top_k
    else:
        ranked = 2 * params.num_beams if params.is_beam else 1
    return max(ranked, params.logprobs or 0)


def check_vocab(params: DecodingParams, vocab_size: int) -> None:
    """Token ids the request names (bias, stop, bad words) must be inside the model's vocabulary."""
    for name, ids in (
        ("logit_bias", params.logit_bias.keys()),
        ("stop_token_ids", params.stop_token_ids),
        ("bad_words_ids", [t for seq in params.bad_words_ids for t in seq]),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        (
            "forced_bos_token_id",
            [] if params.forced_bos_token_id is None else [params.forced_bos_token_id],
        ),
        ("forced_eos_token_ids", params.forced_eos_token_ids),
    ):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise DecodingParamsError(
                name, f"token id {bad[0]} is out of the vocabulary (size {vocab_size})"
            )
