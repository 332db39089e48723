"""vLLM's extension fields of /v1/completions and /v1/chat/completions, as request mixins.

What each field does here (implemented, accepted with no effect, refused) is listed in
server/api/extension_fields.py, the one place the docs' table is generated from. Fields that are
refused are not declared: they stay unknown fields, a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from server.api.openai_model import OpenAIModel, TokenIds

INT64 = 2**63
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"  # echoed in the response id and log lines


class VLLMFields(OpenAIModel):
    """The extension fields both endpoints take."""

    use_beam_search: bool = False  # beam search of width n (num_beams = n)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # slow (sentencepiece) tokenizers only
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep k tokens; -1: all that fit
    truncation_side: Literal["left", "right"] = "left"  # left keeps the last k, right the first k
    allowed_token_ids: TokenIds | None = Field(None, min_length=1)
    return_token_ids: bool = False
    priority: int = Field(0, ge=-INT64, le=INT64 - 1)  # lower runs first
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)  # the response's id
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM's older names of structured_outputs' members (mapped onto it; at most one)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: they change nothing in what this server returns.
    guided_decoding_backend: str | None = None
    session_id: str | None = None
    stream_interval: int | None = Field(None, ge=1)
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool = False
    return_mm_kwargs: bool = True


class VLLMCompletionFields(VLLMFields):
    add_special_tokens: bool = True  # False: the prompt text's own tokens, no BOS added


class VLLMChatFields(VLLMFields):
    add_special_tokens: bool = False  # True: a BOS first unless the template put one there
    echo: bool = False  # the reply starts with the last message's text when it continues it
    documents: list[dict[str, str]] | None = None  # given to the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # given to the chat template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None  # given to the chat template, with enable_thinking as vLLM sets it
    )
    include_reasoning: Literal[True] = True  # replies are never split into reasoning and content
    # Accepted and ignored: no media can be sent to this server (text parts only).
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
