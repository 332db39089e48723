"""A request body's decoding fields -> DecodingParams, with the limits this server sets.

Every DecodingParams field is a request field of the same name and default, passed as is, except
the ones in CONVERTED_FIELDS (tests/test_request_params.py holds both sides to that). Fields a
request leaves unset take the model's sampling defaults (generation_config.json) when the server
applies them (`generation_config_defaults`), as vLLM does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from decoding import DecodingParams, check_vocab, request_width
from decoding.param_checks import parse_logit_bias
from server.api.context import ServingContext
from server.api.errors import bad_request
from server.api.fusion_models import lm_fusion_params
from server.api.protocol import ChatCompletionRequest, CompletionRequest

Request = CompletionRequest | ChatCompletionRequest

# DecodingParams fields that the request carries in another shape, and how each is converted.
CONVERTED_FIELDS: dict[str, str] = {
    "max_tokens": "chat: max_completion_tokens, else max_tokens, else default_max_tokens (config; "
    "0: no default) within the rest of the context that the KV pool holds for every row; "
    "completions: max_tokens, else 16 (OpenAI's default)",
    "stop": "one string or a list of strings -> a tuple",
    "stop_token_ids": "a list or null -> a tuple",
    "logit_bias": "string keys -> token ids, null -> {}",
    "bad_words_ids": "bad_words_ids, then every bad_words string tokenized (also after a space)",
    "logprobs": "completions: logprobs; chat: top_logprobs (0 when absent) if logprobs is true",
    "prompt_logprobs": "prompt_logprobs; completions with echo and logprobs: at least logprobs",
    "allowed_token_ids": "a list or null -> a tuple or None",
    "forced_bos_token_id": "not a request field: an encoder-decoder model's generation config "
    "(generate()'s forced_bos_token_id)",
    "forced_eos_token_ids": "not a request field: an encoder-decoder model's generation config "
    "(generate()'s forced_eos_token_id, one id or several)",
    "begin_suppress_tokens": "not a request field: a speech model's generation config "
    "(generate()'s begin_suppress_tokens)",
    "timestamp_rules": "not a request field: a speech model's transcript with timestamps",
    "logprobs_mode": "not a request field: raw; the audio routes' are processed (the fallback "
    "averages them, as generate() does)",
    "cross_attention": "not a request field: the audio routes' word timestamps read a window's "
    "cross-attention scores",
    "lm_fusion": "an object {model, weight, plausibility} -> LMFusion; its model one of the "
    "server's extra models with the served model's vocabulary",
}
PASSED_AS_IS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(DecodingParams) if f.name not in CONVERTED_FIELDS
)


def decoding_params(
    ctx: ServingContext,
    req: Request,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str = "logprobs",
    max_tokens_param: str = "max_tokens",
    prompt_logprobs: int | None = None,
    prompt_param: str = "prompt",
) -> DecodingParams:
    """Build DecodingParams; limits that depend on the server (context, caps) are checked here.
    `max_tokens` None: the server's default (`default_max_tokens`, within the context).

    Invalid values raise DecodingParamsError, which the app answers with a 400 naming the field.
    """
    stops = req.stop_list()
    _check_server_limits(
        ctx, req, len(stops), (logprobs_param, logprobs), (max_tokens_param, max_tokens)
    )
    _check_scoring(ctx, prompt_len, prompt_logprobs)
    values = _request_values(ctx, req)
    width = request_width(values["n"], values["best_of"], values["num_beams"])
    max_tokens = _max_tokens(ctx, prompt_len, max_tokens, width, max_tokens_param, prompt_param)
    params = DecodingParams(
        **values,
        max_tokens=max_tokens,
        stop=stops,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        bad_words_ids=_bad_words(ctx, req),
        logit_bias=parse_logit_bias(req.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        allowed_token_ids=tuple(req.allowed_token_ids) if req.allowed_token_ids else None,
        lm_fusion=lm_fusion_params(ctx.fusion_models, req.lm_fusion, req.model),
    )
    check_vocab(params, ctx.vocab_size)
    _check_fits_kv_pool(ctx, params, prompt_len, max_tokens_param)
    return params


def _request_values(ctx: ServingContext, req: Request) -> dict[str, Any]:
    """The fields passed as is: the request's, the model's defaults for the sampling fields it
    left unset (pydantic's `model_fields_set`: an explicit null counts as unset, as in vLLM),
    and vLLM's `use_beam_search` as beam search of width n (greedy at n 1)."""
    values = {name: getattr(req, name) for name in PASSED_AS_IS}
    given = req.model_fields_set
    defaults = ctx.sampling_defaults_of(req.model)
    values.update({k: v for k, v in defaults.items() if k not in given})
    if req.use_beam_search:
        if "num_beams" not in given:
            values["num_beams"] = req.n
        if values["num_beams"] == 1 and "do_sample" not in given:
            values["do_sample"] = False  # a beam of width 1 is greedy
    return values


def _max_tokens(
    ctx: ServingContext,
    prompt_len: int,
    max_tokens: int | None,
    width: int,
    max_tokens_param: str,
    prompt_param: str,
) -> int:
    """The request's max_tokens, or the server's default within the room the context and the KV
    pool leave; a prompt that leaves no room names the prompt, a max_tokens beyond it names it."""
    room = ctx.max_model_len - prompt_len
    if room < 0 or (room < 1 and max_tokens != 0):  # 0 only scores the prompt
        raise bad_request(
            f"the prompt has {prompt_len} tokens but this model's maximum context length is "
            f"{ctx.max_model_len} tokens, which leaves no room to generate: shorten the "
            f"{prompt_param} (or set truncate_prompt_tokens)",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        default = ctx.config.default_max_tokens or room
        per_row = ctx.engine.kv_capacity.tokens_per_row(width) - prompt_len
        return max(1, min(room, default, per_row))  # _check_fits_kv_pool names what is too big
    if max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {ctx.max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and {max_tokens_param} asks for {max_tokens} more: lower "
            f"{max_tokens_param} to at most {room}, or shorten the {prompt_param}",
            max_tokens_param,
            "context_length_exceeded",
        )
    return max_tokens


def _check_server_limits(
    ctx: ServingContext,
    req: Request,
    num_stops: int,
    logprobs: tuple[str, int | None],
    max_tokens: tuple[str, int | None],
) -> None:
    """The request's sizes against the server's caps (400 above_limit), before anything else;
    `logprobs` and `max_tokens` are (the field's name in this request, its value)."""
    cfg = ctx.config
    if num_stops > cfg.max_stop_sequences:
        raise bad_request(
            f"at most {cfg.max_stop_sequences} stop sequences are allowed", "stop", "too_many_stop"
        )
    for name, value, cap in (
        ("n", req.n, cfg.max_n),
        ("best_of", req.best_of or 1, cfg.max_best_of),
        ("num_beams", req.num_beams, cfg.max_num_beams),
        (logprobs[0], logprobs[1] or 0, cfg.max_logprobs),
        ("prompt_logprobs", req.prompt_logprobs or 0, cfg.max_logprobs),
        (max_tokens[0], max_tokens[1] or 0, cfg.max_tokens_limit or None),
    ):
        if cap is not None and value > cap:
            raise bad_request(
                f"{name} must be <= {cap} on this server (got {value})", name, "above_limit"
            )


def _check_scoring(ctx: ServingContext, prompt_len: int, prompt_logprobs: int | None) -> None:
    """Scoring a prompt runs the LM head on every prompt position: only up to a configured
    length."""
    cap = ctx.config.max_scored_prompt_tokens
    if prompt_logprobs is not None and prompt_len > cap:
        raise bad_request(
            f"prompt logprobs are computed for prompts of at most {cap} tokens on this server; "
            f"the prompt has {prompt_len}",
            "prompt",
            "above_limit",
        )


def _check_fits_kv_pool(
    ctx: ServingContext, params: DecodingParams, prompt_len: int, max_tokens_param: str
) -> None:
    """Refuse what could never run: after a preemption every row recomputes its whole sequence
    without sharing, so the pool must hold width x (prompt + max_tokens) tokens; otherwise the
    request would be preempted forever and hold up everyone else."""
    if params.is_beam:
        param = "num_beams"
    elif params.strategy == "best_of":
        param = "best_of"
    else:
        param = "n" if params.width > 1 else max_tokens_param
    check_rows_fit(ctx, params.width, prompt_len + params.max_tokens, param)


def check_rows_fit(ctx: ServingContext, width: int, tokens: int, param: str) -> None:
    """A 400 naming `param` when `width` rows of `tokens` tokens each overflow the KV pool."""
    kv = ctx.engine.kv_capacity
    need = width * kv.blocks_for(tokens)
    if need > kv.num_blocks:
        raise bad_request(
            f"this request needs up to {need} KV-cache blocks ({width} rows x {tokens} tokens) "
            f"but the server's pool has {kv.num_blocks}; lower {param}",
            param,
            "kv_cache_too_small",
        )


def _bad_words(ctx: ServingContext, req: Request) -> tuple[tuple[int, ...], ...]:
    """bad_words_ids, then each bad word's tokens; as vLLM, also the tokens of the word after a
    space when they are as many and begin differently (the word in the middle of a text)."""
    words = [tuple(ids) for ids in req.bad_words_ids or ()]
    source = ctx.encoder_decoder
    unset = not req.bad_words_ids and not req.bad_words and ctx.config.generation_config_defaults
    if source is not None and unset:  # generate()'s, from the model's generation config
        words = list(source.bad_words_ids)
    for word in req.bad_words or ():
        if not word.strip():
            raise bad_request(
                "bad_words must not contain empty strings", "bad_words", "invalid_value"
            )
        alone = ctx.tokenizer(word.lstrip(), add_special_tokens=False).input_ids
        spaced = ctx.tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids
        words.append(tuple(alone))
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            words.append(tuple(spaced))
    return tuple(words)
