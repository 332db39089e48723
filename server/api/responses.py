"""Runs jobs in the engine and turns their outputs into whole OpenAI response bodies (streams:
streaming.py)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from server.api import tools
from server.api.errors import APIError
from server.api.logprob_format import chat_logprobs, completion_logprobs, prompt_logprobs
from server.api.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from server.api.serving import Job, ServingContext, reported_model
from server.engine.request import RequestOutput, TokenLogprob


# ---- running jobs --------------------------------------------------------------------------------
def _engine_outputs(
    ctx: ServingContext, request_id: str, job: Job
) -> AsyncGenerator[RequestOutput, None]:
    return ctx.engine.generate(
        request_id,
        job.prompt_ids,
        job.params,
        job.grammar,
        job.model,
        job.source_len,
        job.source_features,
    )


async def run_jobs(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
    """Run every job concurrently in the engine and yield (job, output) as outputs arrive. Engine
    ids are the response's id and a random suffix: unique even when clients reuse a request_id."""
    request_id = f"{request_id}-{secrets.token_hex(4)}"
    if len(jobs) == 1:
        async with aclosing(_engine_outputs(ctx, request_id, jobs[0])) as outs:
            async for out in outs:
                yield jobs[0], out
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput] | None] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async with aclosing(_engine_outputs(ctx, f"{request_id}-{i}", job)) as outs:
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


PromptLogprobs = list[TokenLogprob | None]  # per prompt token, the first None


@dataclass
class ChoiceResult:
    job: Job
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    prompt: PromptLogprobs | None = None  # the job's prompt logprobs, when it asked
    beam_score: float | None = None
    beam_group: int | None = None


async def collect(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> tuple[dict[int, ChoiceResult], Usage]:
    """Run to completion: every choice's text, finish reason and logprobs, plus usage."""
    choices: dict[int, ChoiceResult] = {}
    cached: dict[int, int] = {}  # per job (engine request): its prompt tokens found in the cache
    prompts: dict[int, PromptLogprobs] = {}  # per job: sent with its first output
    async with aclosing(run_jobs(ctx, request_id, jobs)) as outputs:
        async for job, out in outputs:
            _raise_if_error(out)
            cached[id(job)] = out.cached_tokens
            if out.prompt_logprobs is not None:
                prompts[id(job)] = out.prompt_logprobs
            choice = choices.setdefault(
                job.choice_offset + out.index, ChoiceResult(job, text=job.echo_text)
            )
            choice.text += out.text
            choice.token_ids += out.token_ids
            if out.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + out.logprobs
            if out.finished:
                choice.finish_reason = out.finish_reason
                choice.completion_tokens = out.completion_tokens
                choice.beam_score, choice.beam_group = out.beam_score, out.beam_group
    for choice in choices.values():
        choice.prompt = prompts.get(id(choice.job))
    completion_tokens = sum(c.completion_tokens for c in choices.values())
    return choices, usage_of(jobs, completion_tokens, sum(cached.values()))


def usage_of(jobs: list[Job], completion_tokens: int, cached_tokens: int) -> Usage:
    prompt_tokens = sum(j.num_prompt_tokens for j in jobs)
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
        model=reported_model(ctx, jobs[0]),
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                finish_reason=c.finish_reason,
                logprobs=legacy_logprobs(ctx, c.job, c.prompt, c.logprobs, 0),
                prompt_logprobs=vllm_prompt_logprobs(ctx, c.job, c.prompt),
                beam_score=c.beam_score,
                beam_group=c.beam_group,
                token_ids=c.token_ids if c.job.return_token_ids else None,
                prompt_token_ids=prompt_token_ids(c.job),
            )
            for i, c in sorted(choices.items())
        ],
        usage=usage,
    )


def legacy_logprobs(
    ctx: ServingContext,
    job: Job,
    prompt: PromptLogprobs | None,
    generated: list[TokenLogprob] | None,
    text_offset: int,
) -> dict | None:
    """Completions' logprobs: the generated tokens', after the echoed prompt's when the request
    echoes with logprobs (`prompt` is given with a choice's first output only)."""
    gen = generated or []
    if prompt is not None and job.echo_logprobs is not None:
        ids = [*job.prompt_ids, *(e.token_id for e in gen)]
        return completion_logprobs(ctx.tokenizer, ids, [*prompt, *gen], 0, job.echo_logprobs)
    if generated is None:
        return None
    return completion_logprobs(ctx.tokenizer, [e.token_id for e in gen], gen, text_offset)


def prompt_token_ids(job: Job) -> list[int] | None:
    """vLLM's `return_token_ids`: the prompt's ids, as the engine ran them (an encoder-decoder
    model's source: what usage counts)."""
    if not job.return_token_ids:
        return None
    return job.prompt_ids[: job.source_len] if job.source_len else job.prompt_ids


def vllm_prompt_logprobs(
    ctx: ServingContext, job: Job, prompt: PromptLogprobs | None
) -> list | None:
    if prompt is None or job.prompt_logprobs is None:
        return None
    return prompt_logprobs(ctx.tokenizer, prompt, job.prompt_logprobs)


async def chat_response(ctx: ServingContext, request_id: str, job: Job) -> ChatCompletionResponse:
    choices, usage = await collect(ctx, request_id, [job])
    first = choices.get(0)
    return ChatCompletionResponse(
        id=request_id,
        model=reported_model(ctx, job),
        choices=[_chat_choice(ctx, job, i, c) for i, c in sorted(choices.items())],
        usage=usage,
        prompt_logprobs=vllm_prompt_logprobs(ctx, job, first.prompt if first else None),
        prompt_token_ids=prompt_token_ids(job),
    )


def _chat_choice(ctx: ServingContext, job: Job, index: int, c: ChoiceResult) -> ChatChoice:
    message = ChatMessageOut(content=c.text)
    reason = c.finish_reason
    if job.tool_plan is not None:
        parsed = tools.parse_reply(c.text, job.tool_plan)
        if parsed.tool_calls:
            message = ChatMessageOut(content=parsed.content, tool_calls=parsed.tool_calls)
            reason = "tool_calls" if reason == "stop" else reason
    return ChatChoice(
        index=index,
        message=message,
        finish_reason=reason,
        logprobs=chat_logprobs(ctx.tokenizer, c.logprobs) if c.logprobs is not None else None,
        beam_score=c.beam_score,
        beam_group=c.beam_group,
        token_ids=c.token_ids if job.return_token_ids else None,
    )
