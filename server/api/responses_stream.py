"""A Responses API stream: server-sent events in the order OpenAI sends them, each with its
`sequence_number`.

`response.created`, `response.in_progress`; the message item (`response.output_item.added`,
`response.content_part.added`, a `response.output_text.delta` per engine output with text,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`); each
function call (`response.output_item.added`, `response.function_call_arguments.delta` and
`.done`, `response.output_item.done`); then `response.completed` or `response.incomplete`. An
engine failure ends the stream with `error` and `response.failed`.

With tools, text that may be a call is held back (tools.ReplyStream, as chat streams do) and
calls are sent whole when the reply ends; a reply that is only calls has no message item.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from server.api import responses, tools
from server.api.protocol import ToolCallOut
from server.api.responses_api import (
    ResponseCall,
    as_conversation,
    call_item,
    message_item,
    new_item_id,
    outcome,
    output_text,
)


class _Events:
    """Numbers and frames the events of one stream."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class _MessageItem:
    """The streamed message item: opened by its first text, closed once with all of it."""

    def __init__(self, output_index: int) -> None:
        self.id = new_item_id("msg")
        self.output_index = output_index
        self.text = ""
        self.opened = False

    def where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.output_index, "content_index": 0}

    def add(self, event: _Events, delta: str) -> list[str]:
        """Frames for `delta`, after the item's opening ones the first time."""
        frames = []
        if not self.opened:
            self.opened = True
            item = message_item(self.id, None, "in_progress")
            frames.append(
                event("response.output_item.added", output_index=self.output_index, item=item)
            )
            part = output_text("")
            frames.append(event("response.content_part.added", part=part, **self.where()))
        if delta:
            self.text += delta
            frames.append(
                event("response.output_text.delta", delta=delta, logprobs=[], **self.where())
            )
        return frames

    def close(self, event: _Events, status: str) -> list[str]:
        item = message_item(self.id, self.text, status)
        return [
            event("response.output_text.done", text=self.text, logprobs=[], **self.where()),
            event("response.content_part.done", part=output_text(self.text), **self.where()),
            event("response.output_item.done", output_index=self.output_index, item=item),
        ]


def _call_frames(
    event: _Events, output_index: int, call: ToolCallOut
) -> tuple[list[str], dict[str, Any]]:
    item_id = new_item_id("fc")
    where = {"item_id": item_id, "output_index": output_index}
    arguments = call.function.arguments
    done = call_item(item_id, call, "completed")
    frames = [
        event(
            "response.output_item.added",
            output_index=output_index,
            item=call_item(item_id, call, "in_progress", ""),
        ),
        event("response.function_call_arguments.delta", delta=arguments, **where),
        event("response.function_call_arguments.done", arguments=arguments, **where),
        event("response.output_item.done", output_index=output_index, item=done),
    ]
    return frames, done


async def stream_response(call: ResponseCall) -> AsyncGenerator[str, None]:
    """The response's events as its engine outputs arrive; stored at the end (unless
    `store: false`) before the last event, so a client that has it can retrieve it."""
    event = _Events()
    yield event("response.created", response=call.body("in_progress", [], None))
    yield event("response.in_progress", response=call.body("in_progress", [], None))
    plan = call.job.tool_plan
    reply = tools.ReplyStream(plan) if plan is not None else None
    message = _MessageItem(output_index=0)
    calls: list[ToolCallOut] = []
    finish_reason: str | None = None
    completion_tokens = cached_tokens = 0
    async with aclosing(responses.run_jobs(call.ctx, call.id, [call.job])) as outputs:
        async for _, out in outputs:
            if out.error is not None:
                error = {"code": "server_error", "message": out.error}
                yield event("error", code="server_error", message=out.error, param=None)
                yield event("response.failed", response=call.body("failed", [], None, error=error))
                return
            cached_tokens = out.cached_tokens
            delta = reply.push(out.text) if reply is not None else out.text
            if out.finished and reply is not None:
                tail, parsed = reply.finish()
                delta, calls = delta + tail, parsed.tool_calls
            if delta:
                for frame in message.add(event, delta):
                    yield frame
            if out.finished:
                finish_reason, completion_tokens = out.finish_reason, out.completion_tokens
    status, incomplete = outcome(finish_reason)
    item_status = "completed" if status == "completed" else "incomplete"
    output = []
    if message.opened or not calls:  # a reply without calls has a message, if empty
        for frame in [*message.add(event, ""), *message.close(event, item_status)]:
            yield frame
        output.append(message_item(message.id, message.text, item_status))
    for call_out in calls:
        frames, item = _call_frames(event, len(output), call_out)
        output.append(item)
        for frame in frames:
            yield frame
    usage = responses.usage_of([call.job], completion_tokens, cached_tokens)
    body = call.body(status, output, usage, incomplete)
    call.keep(body, as_conversation(message.text if message.opened else None, calls))
    yield event(f"response.{status}", response=body)
