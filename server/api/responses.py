"""Runs jobs in the engine and turns their outputs into OpenAI bodies and server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from server.api import tools
from server.api.errors import APIError
from server.api.logprob_format import chat_logprobs, completion_logprobs
from server.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCallDelta,
    Usage,
)
from server.api.serving import Job, ServingContext
from server.engine.request import RequestOutput, TokenLogprob


# ---- running jobs --------------------------------------------------------------------------------
def _engine_outputs(
    ctx: ServingContext, request_id: str, job: Job
) -> AsyncGenerator[RequestOutput, None]:
    constraint = job.grammar.new_constraint() if job.grammar is not None else None
    return ctx.engine.generate(request_id, job.prompt_ids, job.params, constraint)


async def run_jobs(
    ctx: ServingContext, request_id: str, jobs: list[Job]
) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
    """Run every job concurrently in the engine and yield (job, output) as outputs arrive."""
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
        choices=[_chat_choice(ctx, job, i, c) for i, c in sorted(choices.items())],
        usage=usage,
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
    )


# ---- server-sent events ------------------------------------------------------------------------
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
) -> AsyncGenerator[str, None]:
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
    ctx: ServingContext, request_id: str, n: int, tool_plan: tools.ToolPlan | None = None
) -> tuple[Callable[[int, str, RequestOutput | None], dict], list[dict]]:
    """Chunks of a chat stream. With tools, each choice's text goes through a `ReplyStream`,
    which holds back what may be a call; calls are sent whole when the choice ends."""
    created = int(time.time())
    replies: dict[int, tools.ReplyStream] = {}

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
        text, reason, calls = out.text, out.finish_reason, None
        if tool_plan is not None:
            reply = replies.setdefault(index, tools.ReplyStream(tool_plan))
            text = reply.push(text)
            if out.finished:
                tail, parsed = reply.finish()
                text += tail
                if parsed.tool_calls:
                    calls = [
                        ToolCallDelta(
                            index=k,
                            id=call.id,
                            type="function",
                            function=FunctionCallDelta(
                                name=call.function.name, arguments=call.function.arguments
                            ),
                        )
                        for k, call in enumerate(parsed.tool_calls)
                    ]
                    reason = "tool_calls" if reason == "stop" else reason
        delta = ChatDelta(content=text or None, tool_calls=calls)
        logprobs = chat_logprobs(ctx.tokenizer, out.logprobs) if out.logprobs is not None else None
        return chunk(
            [ChatChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs)]
        )

    first = [
        chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(n)
    ]
    return make, first
