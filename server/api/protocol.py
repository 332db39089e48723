"""OpenAI-compatible request and response bodies (pydantic), plus beamline's decoding extensions."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.api.encoder_decoder import LanguageFields
from server.api.fusion_models import LMFusionField
from server.api.openai_model import NoEffectFields, OpenAIModel, TokenIds
from server.api.vllm_fields import VLLMChatFields, VLLMCompletionFields


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted; chunks carry no obfuscation padding here


class VLLMStreamOptions(StreamOptions):
    continuous_usage_stats: bool = False  # with include_usage: usage in every chunk


class JSONSchemaFormat(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # every schema is enforced, strict or not


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only then')
        return self


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, as llguidance takes it

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice or grammar")
        return self


class SamplingFields(NoEffectFields):
    """Decoding fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: every prompt token's logprob + top k
    # Structured outputs (server/api/structured.py): at most one of the two.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Processors and warpers (ranges are checked by decoding.DecodingParams, naming the field).
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None  # strings, tokenized by the server
    bad_words_ids: list[TokenIds] | None = None
    # Strategies beyond greedy / sampling.
    best_of: int | None = Field(None, ge=1)
    num_beams: int = Field(1, ge=1)
    num_beam_groups: int = Field(1, ge=1)
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    do_sample: bool | None = None
    lm_fusion: LMFusionField | None = None  # a second model's scores in every step

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk when `stream_options.include_usage` asks for it."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: with `include_usage`, every chunk carries usage."""
        return self.include_usage and getattr(self.stream_options, "continuous_usage_stats", False)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields, VLLMCompletionFields, LanguageFields):
    stream_options: VLLMStreamOptions | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt (echo + logprobs), no output
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None  # refused unless empty: no insertion (fill-in-the-middle) here

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]  # all() has checked: p is one prompt of ids
        return list(p)  # type: ignore[arg-type]  # a list of texts or of id lists


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments are enforced by the schema, strict or not


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    # An assistant's refusal, as OpenAI's replies carry it (clients echo their history back): it
    # is what the assistant said, so the prompt holds it where the content would be.
    refusal: str | None = None
    # after role, tool_calls and refusal: whether it may be left out depends on them
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("refusal")
    @classmethod
    def _refusal_from_the_assistant(cls, refusal: str | None, info: ValidationInfo) -> object:
        if refusal is not None and info.data.get("role") not in (None, "assistant"):
            raise PydanticCustomError(
                "invalid_value", "only an assistant message carries a refusal", {}
            )
        return refusal

    @field_validator("content")
    @classmethod
    def _content_unless_tool_calls(cls, content: object, info: ValidationInfo) -> object:
        """As OpenAI: every message has content ("" counts), except an assistant's that carries
        tool calls."""
        role = info.data.get("role")
        said = role == "assistant" and (info.data.get("tool_calls") or info.data.get("refusal"))
        if content is not None or role is None or said:
            return content
        need = "content or tool_calls" if role == "assistant" else "content"
        raise PydanticCustomError(
            "missing_required_parameter",
            "{article} {role} message needs {need} (a string, empty allowed, or text parts)",
            {"article": "an" if role == "assistant" else "a", "role": role, "need": need},
        )

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            content = self.content or ""
        else:
            content = "".join(part.text for part in self.content)
        return content + (self.refusal or "")


class ChatCompletionRequest(SamplingFields, VLLMChatFields):
    stream_options: VLLMStreamOptions | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _unset(value: object) -> bool:
    return value is None


TokenIdsField = Annotated[list[int] | None, Field(exclude_if=_unset)]  # sent only when asked


class Choice(BaseModel):
    """What every choice of a response or chunk carries besides its content; beam strategies add
    the hypothesis' score (HF `sequences_scores`) and, for diverse beams, its group."""

    index: int
    logprobs: Any = None
    finish_reason: str | None = None
    beam_score: Annotated[float | None, Field(exclude_if=_unset)] = None
    beam_group: Annotated[int | None, Field(exclude_if=_unset)] = None
    token_ids: TokenIdsField = None  # vLLM's return_token_ids: this choice's (new) output tokens


class ResponseBody(BaseModel):
    """The envelope of every completion response and chunk; `object` names the kind."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda calls: calls is None)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


# vLLM's prompt_logprobs, sent only when asked for: per prompt token None (the first) or
# {token id: {"logprob", "rank", "decoded_token"}} holding the prompt token and the top k.
PromptLogprobsField = Annotated[
    list[dict[str, dict[str, Any]] | None] | None, Field(exclude_if=_unset)
]


class CompletionChoice(Choice):
    text: str
    prompt_logprobs: PromptLogprobsField = None
    prompt_token_ids: TokenIdsField = None  # return_token_ids: with the choice's first output


class ChatChoice(Choice):
    message: ChatMessageOut


class ChatChunkChoice(Choice):
    delta: ChatDelta


class CompletionResponse(ResponseBody):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(ResponseBody):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage  # always sent
    prompt_logprobs: PromptLogprobsField = None
    prompt_token_ids: TokenIdsField = None  # return_token_ids


class ChatCompletionChunk(ResponseBody):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: TokenIdsField = None  # return_token_ids: in the first chunk
