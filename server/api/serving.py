"""Turns validated API requests into engine requests and engine outputs into OpenAI bodies/chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from decoding import DecodingParams, check_caps
from server.api.errors import APIError, bad_request
from server.api.logprob_format import chat_logprobs, completion_logprobs
from server.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    SamplingFields,
    Usage,
    new_id,
)
from server.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.engine.request import RequestOutput, TokenLogprob
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


# ---- request -> engine inputs ------------------------------------------------------------------
def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def tokenize_prompt(ctx: ServingContext, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        try:
            ids = ctx.tokenizer(prompt, add_special_tokens=True).input_ids
        except Exception as exc:  # e.g. lone surrogates that cannot be encoded
            raise bad_request(
                f"prompt cannot be tokenized: {exc}", param, "invalid_prompt"
            ) from exc
    else:
        ids = list(prompt)
        bad = [t for t in ids if t >= ctx.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is out of the vocabulary (size {ctx.vocab_size})",
                param,
                "invalid_token",
            )
    if not ids or (isinstance(prompt, str) and not prompt):
        raise bad_request("prompt must not be empty", param, "empty_prompt")
    return ids


def chat_prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in req.messages
    ]
    if ctx.tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        ids = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # template errors (e.g. role order) are the client's to fix
        raise bad_request(
            f"messages cannot be formatted by the chat template: {exc}", "messages"
        ) from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# Request fields that pass to DecodingParams unchanged (the rest are converted below).
_SHARED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(DecodingParams)
    if f.name in SamplingFields.model_fields
    and f.name not in ("max_tokens", "stop", "stop_token_ids", "logit_bias", "bad_words_ids")
)


def decoding_params(
    ctx: ServingContext,
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    logprobs_param: str = "logprobs",
    max_tokens_param: str = "max_tokens",
) -> DecodingParams:
    """Build DecodingParams; limits that depend on the server (context, caps) are checked here.

    Invalid values raise DecodingParamsError, which the app answers with a 400 naming the field.
    """
    cfg = ctx.config
    stops = req.stop_list()
    if len(stops) > cfg.max_stop_sequences:
        raise bad_request(
            f"at most {cfg.max_stop_sequences} stop sequences are allowed", "stop", "too_many_stop"
        )
    for name, value, cap in (
        ("n", req.n, cfg.max_n),
        ("best_of", req.best_of or 1, cfg.max_best_of),
        ("num_beams", req.num_beams, cfg.max_num_beams),
        (logprobs_param, logprobs or 0, cfg.max_logprobs),
    ):
        if value > cap:
            raise bad_request(
                f"{name} must be <= {cap} on this server (got {value})", name, "above_limit"
            )
    room = ctx.max_model_len - prompt_len
    if max_tokens is None:  # the rest of the context, within what the KV pool holds for every row
        pool = ctx.engine.engine.pool
        width = req.num_beams if req.num_beams > 1 else max(req.n, req.best_of or 1)
        max_tokens = min(room, (pool.num_blocks // width) * pool.block_size - prompt_len)
        room = max(min(room, max_tokens), 0)
    if room < 1 or max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {ctx.max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens asks for {max_tokens} more",
            max_tokens_param if room >= 1 else "prompt",
            "context_length_exceeded",
        )
    same_name = {name: getattr(req, name) for name in _SHARED_FIELDS}
    params = DecodingParams(
        **same_name,
        max_tokens=max_tokens,
        stop=stops,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        logit_bias=req.logit_bias or {},
        bad_words_ids=_bad_words(ctx, req),
        logprobs=logprobs,
    )
    check_caps(
        params, max(cfg.max_n, cfg.max_best_of, cfg.max_num_beams), cfg.max_logprobs, ctx.vocab_size
    )
    _check_fits_kv_pool(ctx, params, prompt_len, max_tokens_param)
    return params


def _check_fits_kv_pool(
    ctx: ServingContext, params: DecodingParams, prompt_len: int, max_tokens_param: str
) -> None:
    """Refuse what could never run: after a preemption every row recomputes its whole sequence
    without sharing, so the pool must hold width x (prompt + max_tokens) tokens; otherwise the
    request would be preempted forever and hold up everyone else."""
    pool = ctx.engine.engine.pool
    need = params.width * -(-(prompt_len + params.max_tokens) // pool.block_size)
    if need > pool.num_blocks:
        param = {
            "beam": "num_beams",
            "group_beam": "num_beams",
            "beam_sample": "num_beams",
            "best_of": "best_of",
        }.get(params.strategy, "n" if params.width > 1 else max_tokens_param)
        raise bad_request(
            f"this request needs up to {need} KV-cache blocks ({params.width} rows x "
            f"{prompt_len + params.max_tokens} tokens) but the server's pool has {pool.num_blocks}; "
            f"lower {param}",
            param,
            "kv_cache_too_small",
        )


def _bad_words(ctx: ServingContext, req: SamplingFields) -> tuple[tuple[int, ...], ...]:
    words = [tuple(ids) for ids in req.bad_words_ids or ()]
    for word in req.bad_words or ():
        if not word:
            raise bad_request(
                "bad_words must not contain empty strings", "bad_words", "invalid_value"
            )
        words.append(tuple(ctx.tokenizer(word, add_special_tokens=False).input_ids))
    return tuple(words)


@dataclass
class Job:
    """One engine request: a prompt of the API request and the choice offset of its outputs."""

    prompt_ids: list[int]
    params: DecodingParams
    choice_offset: int
    echo_text: str = ""  # completions with echo: the prompt text, sent before each choice


def completion_jobs(ctx: ServingContext, req: CompletionRequest) -> list[Job]:
    check_model(ctx, req.model)
    if req.echo and req.logprobs is not None:
        raise bad_request(
            "echo together with logprobs is not supported (no prompt logprobs)",
            "echo",
            "unsupported",
        )
    prompts = req.prompts()
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt", "empty_prompt")
    if len(prompts) > ctx.config.max_prompts_per_request:
        raise bad_request(
            f"at most {ctx.config.max_prompts_per_request} prompts per request",
            "prompt",
            "too_many_prompts",
        )
    jobs = []
    for i, prompt in enumerate(prompts):
        ids = tokenize_prompt(ctx, prompt, "prompt")
        params = decoding_params(ctx, req, len(ids), req.max_tokens or 16, req.logprobs)
        echo = (
            (prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids)) if req.echo else ""
        )
        jobs.append(Job(ids, params, i * req.n, echo))
    return jobs


def chat_job(ctx: ServingContext, req: ChatCompletionRequest) -> Job:
    check_model(ctx, req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    ids = chat_prompt_ids(ctx, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = decoding_params(
        ctx,
        req,
        len(ids),
        req.max_completion_tokens or req.max_tokens,
        logprobs,
        "top_logprobs",
        "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
    )
    return Job(ids, params, 0)


# ---- running jobs --------------------------------------------------------------------------------
async def run_jobs(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Run every job concurrently in the engine and yield (job, output) as outputs arrive."""
    if len(jobs) == 1:
        async with aclosing(
            ctx.engine.generate(request_id, jobs[0].prompt_ids, jobs[0].params)
        ) as outs:
            async for out in outs:
                yield jobs[0], out
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput] | None] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async with aclosing(
                ctx.engine.generate(f"{request_id}-{i}", job.prompt_ids, job.params)
            ) as outs:
                async for out in outs:
                    await queue.put((job, out))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if item is None:
                pending -= 1
            else:
                yield item
        for t in tasks:
            t.result()  # surface a failure of the engine call itself
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _raise_if_error(out: RequestOutput) -> None:
    if out.error is not None:
        raise APIError(500, out.error, code="engine_error")


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    completion_tokens: int = 0


async def collect(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> tuple[dict[int, ChoiceResult], Usage]:
    """Run to completion: every choice's text, finish reason and logprobs, plus usage."""
    choices: dict[int, ChoiceResult] = {}
    cached: dict[int, int] = {}  # per job (engine request): its prompt tokens found in the cache
    async with aclosing(run_jobs(ctx, request_id, jobs)) as outputs:
        async for job, out in outputs:
            _raise_if_error(out)
            cached[id(job)] = out.cached_tokens
            choice = choices.setdefault(
                job.choice_offset + out.index, ChoiceResult(text=job.echo_text)
            )
            choice.text += out.text
            if out.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + out.logprobs
            if out.finished:
                choice.finish_reason = out.finish_reason
                choice.completion_tokens = out.completion_tokens
    completion_tokens = sum(c.completion_tokens for c in choices.values())
    return choices, _usage(jobs, completion_tokens, sum(cached.values()))


def _usage(jobs: list[Job], completion_tokens: int, cached_tokens: int) -> Usage:
    prompt_tokens = sum(len(j.prompt_ids) for j in jobs)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


async def completion_response(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> CompletionResponse:
    choices, usage = await collect(ctx, request_id, jobs)
    return CompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=completion_logprobs(ctx.tokenizer, c.logprobs, 0)
                if c.logprobs is not None
                else None,
            )
            for i, c in sorted(choices.items())
        ],
        usage=usage,
    )


async def chat_response(ctx: ServingContext, request_id: str, job: Job) -> ChatCompletionResponse:
    choices, usage = await collect(ctx, request_id, [job])
    return ChatCompletionResponse(
        id=request_id,
        model=ctx.model_name,
        choices=[
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=c.text),
                finish_reason=c.finish_reason,
                logprobs=chat_logprobs(ctx.tokenizer, c.logprobs)
                if c.logprobs is not None
                else None,
            )
            for i, c in sorted(choices.items())
        ],
        usage=usage,
    )


# ---- server-sent events ----------------------------------------------------------------------------
def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_events(
    ctx: ServingContext,
    request_id: str,
    jobs: list[Job],
    include_usage: bool,
    make_chunk: Callable[[int, str, RequestOutput | None], dict],
    first_chunks: Sequence[dict] = (),
) -> AsyncIterator[str]:
    """SSE stream: a chunk per output with content, usage last when asked, then [DONE].

    Sampled strategies stream each choice token by token (chunks carry the choice `index`); beam
    strategies and best_of know their answer only at the end and send each final choice whole.
    """
    for chunk in first_chunks:
        yield sse(chunk)
    completion_tokens = 0
    failed = False
    echoed: set[int] = set()
    cached: dict[int, int] = {}
    async with aclosing(run_jobs(ctx, request_id, jobs)) as outputs:
        async for job, out in outputs:
            cached[id(job)] = out.cached_tokens
            if out.error is not None:
                yield sse(APIError(500, out.error, code="engine_error").body())
                failed = True
                break
            index = job.choice_offset + out.index
            prefix = ""
            if job.echo_text and index not in echoed:
                echoed.add(index)
                prefix = job.echo_text
            if out.finished:
                completion_tokens += out.completion_tokens
            if out.text or out.finished or out.logprobs or prefix:
                chunk = make_chunk(index, prefix, out)
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
    if include_usage and not failed:
        final = make_chunk(0, "", None)
        final["usage"] = _usage(jobs, completion_tokens, sum(cached.values())).model_dump()
        yield sse(final)
    yield sse("[DONE]")


def completion_chunk_maker(
    ctx: ServingContext, request_id: str
) -> Callable[[int, str, RequestOutput | None], dict]:
    created = int(time.time())
    offsets: dict[int, int] = {}  # text_offset so far, per choice

    def make(index: int, prefix: str, out: RequestOutput | None) -> dict:
        choices = []
        if out is not None:
            text = prefix + out.text
            logprobs = None
            if out.logprobs is not None:
                logprobs = completion_logprobs(
                    ctx.tokenizer, out.logprobs, offsets.get(index, len(prefix))
                )
            offsets[index] = offsets.get(index, 0) + len(text)
            choices = [
                CompletionChoice(
                    index=index, text=text, finish_reason=out.finish_reason, logprobs=logprobs
                ).model_dump()
            ]
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }

    return make


def chat_chunk_maker(
    ctx: ServingContext, request_id: str, n: int
) -> tuple[Callable[[int, str, RequestOutput | None], dict], list[dict]]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice]) -> dict:
        body = ChatCompletionChunk(
            id=request_id, created=created, model=ctx.model_name, choices=choices
        ).model_dump(exclude={"usage"})
        for choice in body["choices"]:  # OpenAI sends only the delta fields that are set
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return body

    def make(index: int, prefix: str, out: RequestOutput | None) -> dict:
        if out is None:
            return chunk([])
        delta = ChatDelta(content=out.text) if out.text else ChatDelta()
        logprobs = chat_logprobs(ctx.tokenizer, out.logprobs) if out.logprobs is not None else None
        return chunk(
            [
                ChatChunkChoice(
                    index=index, delta=delta, finish_reason=out.finish_reason, logprobs=logprobs
                )
            ]
        )

    first = [
        chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(n)
    ]
    return make, first


def new_request_id(kind: str) -> str:
    return new_id("chatcmpl" if kind == "chat" else "cmpl")
