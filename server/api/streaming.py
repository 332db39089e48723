"""Server-sent events: a request's outputs as OpenAI stream chunks, as they arrive."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from server.api import tools
from server.api.errors import APIError
from server.api.logprob_format import chat_logprobs
from server.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    FunctionCallDelta,
    ToolCallDelta,
)
from server.api.responses import (
    PromptLogprobs,
    legacy_logprobs,
    run_jobs,
    usage_of,
    vllm_prompt_logprobs,
)
from server.api.serving import Job, ServingContext
from server.engine.request import RequestOutput


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_events(
    ctx: ServingContext,
    request_id: str,
    jobs: list[Job],
    include_usage: bool,
    make_chunk: ChunkMaker,
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
    started: set[int] = set()  # choices that sent their first chunk
    cached: dict[int, int] = {}
    prompts: dict[int, PromptLogprobs] = {}  # per job: sent with its first output
    async with aclosing(run_jobs(ctx, request_id, jobs)) as outputs:
        async for job, out in outputs:
            cached[id(job)] = out.cached_tokens
            if out.prompt_logprobs is not None:
                prompts[id(job)] = out.prompt_logprobs
            if out.error is not None:
                yield sse(APIError(500, out.error, code="engine_error").body())
                failed = True
                break
            index = job.choice_offset + out.index
            prefix, prompt = "", None
            if index not in started:  # the echo and the prompt's logprobs open each choice
                started.add(index)
                prefix, prompt = job.echo_text, prompts.get(id(job))
            if out.finished:
                completion_tokens += out.completion_tokens
            if out.text or out.finished or out.logprobs or prefix or prompt is not None:
                chunk = make_chunk(ChunkInput(job, index, prefix, out, prompt))
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
    if include_usage and not failed:
        final = make_chunk(None)
        final["usage"] = usage_of(jobs, completion_tokens, sum(cached.values())).model_dump()
        yield sse(final)
    yield sse("[DONE]")


@dataclass
class ChunkInput:
    """One output of one choice, as a stream chunk needs it; the first of each choice also
    carries the echo text and the job's prompt logprobs (when asked for)."""

    job: Job
    index: int
    prefix: str
    out: RequestOutput
    prompt: PromptLogprobs | None = None


ChunkMaker = Callable[[ChunkInput | None], dict]  # None: the closing usage chunk


def completion_chunk_maker(ctx: ServingContext, request_id: str) -> ChunkMaker:
    created = int(time.time())
    offsets: dict[int, int] = {}  # text_offset so far, per choice: token texts sent

    def make(part: ChunkInput | None) -> dict:
        choices = []
        if part is not None:
            index, out = part.index, part.out
            logprobs = legacy_logprobs(
                ctx, part.job, part.prompt, out.logprobs, offsets.get(index, 0)
            )
            if logprobs is not None and logprobs["tokens"]:
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choices = [
                CompletionChoice(
                    index=index,
                    text=part.prefix + out.text,
                    finish_reason=out.finish_reason,
                    logprobs=logprobs,
                    prompt_logprobs=vllm_prompt_logprobs(ctx, part.job, part.prompt),
                    beam_score=out.beam_score,
                    beam_group=out.beam_group,
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
) -> tuple[ChunkMaker, list[dict]]:
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

    def make(part: ChunkInput | None) -> dict:
        if part is None:
            return chunk([])
        index, out = part.index, part.out
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
        body = chunk(
            [
                ChatChunkChoice(
                    index=index,
                    delta=delta,
                    finish_reason=reason,
                    logprobs=logprobs,
                    beam_score=out.beam_score,
                    beam_group=out.beam_group,
                )
            ]
        )
        scored = vllm_prompt_logprobs(ctx, part.job, part.prompt)
        if scored is not None:
            body["prompt_logprobs"] = scored
        return body

    first = [
        chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        for i in range(n)
    ]
    return make, first
