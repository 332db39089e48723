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
    prompt_token_ids,
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
    continuous_usage: bool = False,
) -> AsyncGenerator[str, None]:
    """SSE stream: a chunk per output with content, usage last when asked (in every chunk too
    with vLLM's `continuous_usage_stats`), then [DONE].

    Sampled strategies stream each choice token by token (chunks carry the choice `index`); beam
    strategies and best_of know their answer only at the end and send each final choice whole.
    Chat's opening chunks (`first_chunks`) come first, the first with the prompt's token ids when
    the request asked for them (`return_token_ids`).
    """
    tokens: dict[int, int] = {}  # per choice: its completion tokens so far
    cached: dict[int, int] = {}  # per job: its prompt tokens found in the prefix cache

    def usage() -> dict | None:
        if not continuous_usage:
            return None
        return usage_of(jobs, sum(tokens.values()), sum(cached.values())).model_dump()

    for i, chunk in enumerate(first_chunks):
        if i == 0 and jobs[0].return_token_ids:
            chunk = {**chunk, "prompt_token_ids": jobs[0].prompt_ids}
        yield sse({**chunk, "usage": usage()} if include_usage else chunk)
    completion_tokens = 0
    failed = False
    started: set[int] = set()  # choices that sent their first chunk
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
            first = index not in started
            prefix, prompt = "", None
            if first:  # the echo and the prompt's logprobs open each choice
                started.add(index)
                prefix, prompt = job.echo_text, prompts.get(id(job))
            tokens[index] = out.completion_tokens
            if out.finished:
                completion_tokens += out.completion_tokens
            ids = job.return_token_ids and bool(out.token_ids)  # their text may come later
            if out.text or out.finished or out.logprobs or prefix or prompt is not None or ids:
                chunk = make_chunk(ChunkInput(job, index, prefix, out, prompt, first))
                if include_usage:
                    chunk["usage"] = usage()
                yield sse(chunk)
    if include_usage and not failed:
        final = make_chunk(None)
        final["usage"] = usage_of(jobs, completion_tokens, sum(cached.values())).model_dump()
        yield sse(final)
    yield sse("[DONE]")


@dataclass
class ChunkInput:
    """One output of one choice, as a stream chunk needs it; the first of each choice also
    carries the echo text and the job's prompt logprobs (when asked for); with
    `return_token_ids` each carries its new token ids."""

    job: Job
    index: int
    prefix: str
    out: RequestOutput
    prompt: PromptLogprobs | None = None
    first: bool = False  # the choice's first chunk (completions: it carries the prompt's ids)


ChunkMaker = Callable[[ChunkInput | None], dict]  # None: the closing usage chunk


def completion_chunk_maker(ctx: ServingContext, request_id: str, model: str) -> ChunkMaker:
    """Chunks of a completion stream; `model`: the id they name (serving.reported_model)."""
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
                    token_ids=out.token_ids if part.job.return_token_ids else None,
                    prompt_token_ids=prompt_token_ids(part.job) if part.first else None,
                ).model_dump()
            ]
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    return make


def chat_chunk_maker(
    ctx: ServingContext,
    request_id: str,
    n: int,
    tool_plan: tools.ToolPlan | None = None,
    model: str | None = None,
) -> tuple[ChunkMaker, list[dict]]:
    """Chunks of a chat stream. With tools, each choice's text goes through a `ReplyStream`,
    which holds back what may be a call; calls are sent whole when the choice ends."""
    created = int(time.time())
    replies: dict[int, tools.ReplyStream] = {}

    def chunk(choices: list[ChatChunkChoice]) -> dict:
        body = ChatCompletionChunk(
            id=request_id, created=created, model=model or ctx.model_name, choices=choices
        ).model_dump(exclude={"usage"})
        for choice in body["choices"]:  # OpenAI sends only the delta fields that are set
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return body

    def make(part: ChunkInput | None) -> dict:
        if part is None:
            return chunk([])
        index, out = part.index, part.out
        text, reason, calls = part.prefix + out.text, out.finish_reason, None
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
                    token_ids=out.token_ids if part.job.return_token_ids else None,
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
