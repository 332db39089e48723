"""OpenAI-compatible request and response bodies (pydantic), plus beamline's decoding extensions."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do for forward compatibility.
    # Strict types: "0.5" is not a temperature and true is not a token count (ints still pass as
    # floats).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


TokenIds = list[Annotated[int, Field(ge=0)]]


class SamplingFields(OpenAIModel):
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
    user: str | None = None
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

    @property
    def include_usage(self) -> bool:
        """A stream ends with a usage chunk when `stream_options.include_usage` asks for it."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)

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


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Choice(BaseModel):
    """What every choice of a response or chunk carries besides its content."""

    index: int
    logprobs: Any = None
    finish_reason: str | None = None


class ResponseBody(BaseModel):
    """The envelope of every completion response and chunk; `object` names the kind."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class CompletionChoice(Choice):
    text: str


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


class ChatCompletionChunk(ResponseBody):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "beamline"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
