"""The OpenAI Responses API's request body (pydantic), checked and named as OpenAI names its
fields in errors (`input[2].content[0].text`, `text.format.schema`).

The decoding fields are chat's (`SamplingFields`); what the Responses API spells differently
(`max_output_tokens`, `text.format`) or cannot return (`n` > 1, prompt logprobs) is refused,
naming the field, as is every field that would change the response and is not implemented here
(`reasoning` effort, `background`, `include`, non-function tools, `truncation: "auto"`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from server.api.errors import APIError, bad_request
from server.api.protocol import FunctionDefinition, JSONSchemaFormat, OpenAIModel, SamplingFields

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _by_type(*models: type[OpenAIModel], what: str, default: str | None = None) -> Discriminator:
    """Chooses the member of a union of `models` by the `type` each declares. Members are tagged
    by class name (`Annotated[Model, Tag("Model")]`), which is no field name, so that error
    params leave them out; any other type is an `unsupported_type` error listing the supported."""
    tags = {model.model_fields["type"].annotation.__args__[0]: model.__name__ for model in models}  # type: ignore[union-attr]

    def pick(value: Any) -> str | None:
        kind = (
            value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        )
        return tags.get(kind) if isinstance(kind, str) else None

    supported = ", ".join(repr(kind) for kind in tags)
    return Discriminator(
        pick,
        custom_error_type="unsupported_type",
        custom_error_message=f"this server takes {what} of type {supported}",
    )


# ---- input items ---------------------------------------------------------------------------------
class InputText(OpenAIModel):
    type: Literal["input_text"]
    text: str


class OutputText(OpenAIModel):
    """An assistant's text, as clients send an earlier response's output back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None  # none are produced here; resent as given
    logprobs: list[dict[str, Any]] | None = None


ContentPart = Annotated[
    Annotated[InputText, Tag("InputText")] | Annotated[OutputText, Tag("OutputText")],
    _by_type(InputText, OutputText, what="content parts"),
]


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    # An earlier response's output items carry these; they change nothing in the prompt.
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
    _by_type(
        MessageItem, FunctionCallItem, FunctionCallOutputItem, what="input items", default="message"
    ),
]


# ---- tools and output format ---------------------------------------------------------------------
class FunctionTool(FunctionDefinition):
    """The Responses shape of a function tool: chat's `function` fields beside `type`."""

    type: Literal["function"]


Tool = Annotated[Annotated[FunctionTool, Tag("FunctionTool")], _by_type(FunctionTool, what="tools")]


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormatText(OpenAIModel):
    type: Literal["text"]


class TextFormatJSONObject(OpenAIModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(JSONSchemaFormat):
    type: Literal["json_schema"]


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("TextFormatText")]
    | Annotated[TextFormatJSONObject, Tag("TextFormatJSONObject")]
    | Annotated[TextFormatJSONSchema, Tag("TextFormatJSONSchema")],
    _by_type(TextFormatText, TextFormatJSONObject, TextFormatJSONSchema, what="text formats"),
]


class TextConfig(OpenAIModel):
    format: TextFormat = TextFormatText(type="text")
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(OpenAIModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(SamplingFields):
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before everything else
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True  # keep the response for previous_response_id and GET (as OpenAI does)
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: ReasoningConfig | None = None
    background: bool = False
    include: list[str] | None = None

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormatText(type="text")


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """The validated request, or a 400 naming the field as OpenAI does."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    refuse_unsupported(req)
    _check_parts(req)
    return req


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields that would change the response and are not implemented here: a 400 each."""
    reasoning = req.reasoning or ReasoningConfig()
    verbosity = req.text.verbosity if req.text else None
    no_reasoning = "this model does not reason"
    refusals = [
        (req.n != 1, "n", "a response has one output (beams and best_of return their best)"),
        (req.max_tokens is not None, "max_tokens", "use max_output_tokens"),
        (req.response_format is not None, "response_format", "use text.format"),
        (req.prompt_logprobs is not None, "prompt_logprobs", "a response has no prompt logprobs"),
        (reasoning.effort not in (None, "none"), "reasoning.effort", no_reasoning),
        (reasoning.summary is not None, "reasoning.summary", no_reasoning),
        (reasoning.generate_summary is not None, "reasoning.generate_summary", no_reasoning),
        (verbosity not in (None, "medium"), "text.verbosity", "only the default, medium"),
        (req.truncation == "auto", "truncation", "input that does not fit is a 400"),
        (req.background, "background", "responses run while the request is open"),
        (bool(req.include), "include", "no extra output data is produced here"),
    ]
    for refused, param, why in refusals:
        if refused:
            raise bad_request(f"{param} is not supported here: {why}", param, "unsupported")


def _check_parts(req: ResponsesRequest) -> None:
    """Output text is the assistant's: other roles send input text."""
    for i, item in enumerate(req.input if isinstance(req.input, list) else []):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            if isinstance(part, OutputText) and item.role != "assistant":
                raise bad_request(
                    f"output_text is an assistant's content; a {item.role} message sends "
                    "input_text",
                    f"input[{i}].content[{j}].type",
                    "invalid_value",
                )


ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


def conversation_items(given: str | list[InputItem]) -> list[ConversationItem]:
    """`input` as a list of items: a text is one user message."""
    if isinstance(given, str):
        return [MessageItem(role="user", content=given)]
    return list(given)


# ---- errors named as OpenAI names fields ---------------------------------------------------------
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def openai_param(loc: Sequence[int | str]) -> str | None:
    """`("input", "list[...]", 2, "MessageItem", "content")` -> `input[2].content`: list indexes in
    brackets, union members (types, class names) left out."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
    return param or None


def validation_error(errors: list[Any]) -> APIError:
    """The most specific error (a union reports one per member; the deepest is the one meant)."""
    first = max(errors, key=lambda e: len(openai_param(e["loc"]) or ""))
    param = openai_param(first["loc"])
    code = "invalid_value"
    if first["type"] == "unsupported_type":
        param, code = f"{param}.type", "unsupported"
    if first["type"] == "extra_forbidden":
        message = (
            f"unknown field {param!r}: this server does not implement it (fields that change "
            "nothing here are accepted; see docs/reference/request-fields.md)"
        )
        return bad_request(message, param, "unknown_field")
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return bad_request(message, param, code)
