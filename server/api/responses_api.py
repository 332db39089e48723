"""`POST /v1/responses`: the OpenAI Responses API over the chat path.

A request becomes a `ChatCompletionRequest` (instructions as a system message first, then the
conversation so far and the input items as chat messages, function tools, `tool_choice`,
`text.format` as `response_format`) and runs as `chat_job`, so chat templates, tool-call parsing,
structured outputs and every decoding strategy behave exactly as on chat. Its one choice becomes
output items: a `message` with the text and a `function_call` per call read from it. Errors name
the Responses fields (`max_output_tokens`, not `max_tokens`). Streams: responses_stream.py.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from decoding import DecodingParamsError
from server.api import responses, serving, tools
from server.api.context import ServingContext
from server.api.errors import APIError
from server.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    SamplingFields,
    ToolCall,
    ToolCallOut,
    Usage,
)
from server.api.response_store import ResponseStore, StoredResponse
from server.api.responses_protocol import (
    ConversationItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    conversation_items,
    parse_request,
    validation_error,
)
from server.api.serving import Job

# Chat's names of the fields a Responses request sets differently (in errors from the chat path).
_CHAT_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}
# How an engine finish reason ends a response: its status and `incomplete_details.reason`.
_OUTCOMES = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "no_legal_token": ("incomplete", "content_filter"),  # the constraint left no token
}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseCall:
    """One Responses request on its way through the chat path."""

    ctx: ServingContext
    store: ResponseStore
    req: ResponsesRequest
    job: Job
    conversation: list[ConversationItem]  # what came before and this request's input items
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def streams(self) -> bool:
        return self.req.stream

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None,
        incomplete: str | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The response object, echoing the request's settings as OpenAI does."""
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
            "model": serving.reported_model(self.ctx, self.job),
            "output": output,
            "usage": _usage(usage) if usage is not None else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": self.job.params.temperature,  # as run (defaults applied)
            "top_p": self.job.params.top_p,
            "tools": [t.model_dump(by_alias=True) for t in req.tools or ()],
            "tool_choice": _tool_choice(req),
            "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": req.text_format.model_dump(by_alias=True, exclude_none=True)},
            "previous_response_id": req.previous_response_id,
            "store": req.store and self.store.enabled,
            "metadata": req.metadata or {},
            "user": req.user,
            "truncation": req.truncation,
            "reasoning": {"effort": None, "summary": None},
            "background": False,
            "service_tier": "default",
            "prompt_cache_key": req.prompt_cache_key,
            "safety_identifier": req.safety_identifier,
        }

    def keep(self, body: dict[str, Any], output: list[ConversationItem]) -> None:
        """Store the finished response (unless `store: false`) for follow-ups and GET."""
        if self.req.store:
            self.store.put(self.id, StoredResponse(body, [*self.conversation, *output]))


async def prepare(ctx: ServingContext, store: ResponseStore, body: dict[str, Any]) -> ResponseCall:
    """Validate the request and build its chat job (constraint compiled), or raise a 400."""
    req = parse_request(body)
    before = (
        store.previous(req.previous_response_id).conversation if req.previous_response_id else []
    )
    conversation = [*before, *conversation_items(req.input)]
    with _responses_param_names():
        job = serving.chat_job(ctx, chat_request(req, conversation))
        await serving.compile_constraints(ctx, [job])
    return ResponseCall(ctx, store, req, job, conversation)


def chat_request(
    req: ResponsesRequest, conversation: list[ConversationItem]
) -> ChatCompletionRequest:
    messages = chat_messages(conversation)
    if req.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    if not messages:
        raise APIError(400, "input must not be empty", param="input", code="empty_prompt")
    shared = set(SamplingFields.model_fields) - {"stream", "stream_options"}
    fields = req.model_dump(include=shared, exclude_unset=True, by_alias=True)
    fmt = req.text_format
    if isinstance(fmt, TextFormatJSONSchema):
        schema = fmt.model_dump(exclude={"type"}, by_alias=True, exclude_none=True)
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, TextFormatJSONObject):
        fields["response_format"] = {"type": "json_object"}
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest.model_validate(
            {
                **fields,
                "messages": messages,
                "max_completion_tokens": req.max_output_tokens,
                "tools": [
                    {"type": "function", "function": t.model_dump(exclude={"type"}, by_alias=True)}
                    for t in req.tools or ()
                ]
                or None,
                "tool_choice": choice,
                "parallel_tool_calls": req.parallel_tool_calls,
            }
        )
    except ValidationError as exc:  # chat's own checks of what the request converted to
        raise validation_error(exc.errors()) from None


def chat_messages(items: list[ConversationItem]) -> list[ChatMessage]:
    """Items as chat messages: function calls join the assistant message before them (one turn
    with its text and calls, as chat has it); their outputs are tool messages."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = last.model_copy(
                    update={"tool_calls": [*(last.tool_calls or ()), call]}
                )
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text())
            )
        else:
            messages.append(ChatMessage(role=item.role, content=item.text()))
    return messages


@contextmanager
def _responses_param_names() -> Iterator[None]:
    """Errors of the chat path name the Responses fields (`max_output_tokens`, `input`)."""
    try:
        yield
    except APIError as exc:
        if exc.param not in _CHAT_PARAMS:
            raise
        param = _CHAT_PARAMS[exc.param]
        raise APIError(
            exc.status,
            _renamed(exc.message, param),
            type=exc.type,
            param=param,
            code=exc.code,
            headers=exc.headers,
        ) from exc
    except DecodingParamsError as exc:
        param = _CHAT_PARAMS.get(exc.field, exc.field)
        raise APIError(
            400, _renamed(exc.message, param), param=param, code="invalid_value"
        ) from exc


def _renamed(message: str, param: str) -> str:
    """The message with chat's names of `param` (`max_tokens`, `max_completion_tokens`) as the
    Responses API names it."""
    for chat_name, name in _CHAT_PARAMS.items():
        if name == param:
            message = re.sub(rf"\b{re.escape(chat_name)}\b", param, message)
    return message


# ---- the response --------------------------------------------------------------------------------
def outcome(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of a response whose choice ended with `finish_reason`."""
    return _OUTCOMES.get(finish_reason or "", ("incomplete", None))


def reply_parts(text: str, plan: tools.ToolPlan | None) -> tuple[str | None, list[ToolCallOut]]:
    """A reply's message text (None: there is only calls) and the calls read from it."""
    if plan is None:
        return text, []
    parsed = tools.parse_reply(text, plan)
    return (parsed.content if parsed.tool_calls else text), parsed.tool_calls


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The assistant's message item; None: a streamed one before its content part."""
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [output_text(text)] if text is not None else [],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(
    item_id: str, call: ToolCallOut, status: str, arguments: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments if arguments is None else arguments,
        "status": status,
    }


def as_conversation(text: str | None, calls: list[ToolCallOut]) -> list[ConversationItem]:
    """A reply as the items a follow-up continues from."""
    items: list[ConversationItem] = []
    if text is not None:
        items.append(MessageItem(role="assistant", content=text))
    for call in calls:
        items.append(
            FunctionCallItem(
                type="function_call",
                call_id=call.id,
                name=call.function.name,
                arguments=call.function.arguments,
            )
        )
    return items


async def respond(call: ResponseCall) -> JSONResponse:
    """Run to the end and answer the whole response (stored unless `store: false`)."""
    choices, usage = await responses.collect(call.ctx, call.id, [call.job])
    choice = choices[0]
    status, incomplete = outcome(choice.finish_reason)
    item_status = "completed" if status == "completed" else "incomplete"
    text, calls = reply_parts(choice.text, call.job.tool_plan)
    output = [message_item(new_item_id("msg"), text, item_status)] if text is not None else []
    output += [call_item(new_item_id("fc"), c, "completed") for c in calls]
    body = call.body(status, output, usage, incomplete)
    call.keep(body, as_conversation(text, calls))
    return JSONResponse(body)


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    if isinstance(req.tool_choice, FunctionChoice):
        return req.tool_choice.model_dump()
    return req.tool_choice or ("auto" if req.tools else "none")
