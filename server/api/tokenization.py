"""Text <-> token ids as the server sees them: prompt encoding, and the tokenizer routes
(`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`) in vLLM's request and response
shapes, so that clients which count tokens themselves (lm-evaluation-harness) use this server's
tokenizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from server.api import tools
from server.api.context import ServingContext
from server.api.encoder_decoder import refuse_chat
from server.api.errors import bad_request
from server.api.protocol import ChatCompletionRequest, ChatMessage, OpenAIModel, TokenIds, Tool


class TokenizePromptRequest(OpenAIModel):
    """vLLM's POST /tokenize with a prompt: its ids as /v1/completions runs them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # False: the text's own tokens, no BOS added
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    """vLLM's POST /tokenize with messages: their ids as /v1/chat/completions runs them."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # True: a BOS first unless the template put one there
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether encoding a text with special tokens puts the BOS token first."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("", add_special_tokens=True).input_ids[:1] == [bos]


def encode_text(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    param: str = "prompt",
    add_special_tokens: bool = True,
) -> list[int]:
    """A text prompt's ids, with the tokenizer's special tokens unless told otherwise, except that
    a text that already begins with the BOS token (clients that build prompts themselves send
    one) gets no second. A text the tokenizer cannot encode is a 400 naming `param`."""
    bos = tokenizer.bos_token
    if isinstance(bos, str) and bos and text.startswith(bos):
        add_special_tokens = False
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    except Exception as exc:  # e.g. lone surrogates that cannot be encoded
        raise bad_request(f"prompt cannot be tokenized: {exc}", param, "invalid_prompt") from exc


def check_ids(ctx: ServingContext, ids: list[int], param: str) -> None:
    bad = [t for t in ids if t >= ctx.vocab_size]
    if bad:
        raise bad_request(
            f"token id {bad[0]} is out of the vocabulary (size {ctx.vocab_size})",
            param,
            "invalid_token",
        )


def tokenize(ctx: ServingContext, req: TokenizePromptRequest | TokenizeChatRequest) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"}: a prompt's ids as /v1/completions
    would run them, or messages' ids as /v1/chat/completions would."""
    if isinstance(req, TokenizePromptRequest):
        ids = encode_text(ctx.tokenizer, req.prompt, "prompt", req.add_special_tokens)
    elif ctx.encoder_decoder is not None:  # as the chat routes answer on such a model
        refuse_chat()
    else:
        ids = _chat_ids(ctx, req)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def _chat_ids(ctx: ServingContext, req: TokenizeChatRequest) -> list[int]:
    chat = ChatCompletionRequest.model_validate(
        req.model_dump(
            include={
                "messages",
                "tools",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
            },
            exclude_unset=True,
            by_alias=True,
        )
    )
    return chat_prompt_ids(ctx, chat, tools.plan_tools(chat, ctx.tokenizer.chat_template))


# apply_chat_template's own arguments, and the template's `messages`: not template variables a
# request's chat_template_kwargs may set (a client's `chat_template` would run its own code)
RESERVED_TEMPLATE_KWARGS = frozenset(
    set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "kwargs"}
    | {"messages"}
)


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The request's extra chat template variables: `chat_template_kwargs`, and vLLM's meaning of
    `reasoning_effort` (given as is, with enable_thinking unless the kwargs set it)."""
    extra = dict(req.chat_template_kwargs or {})
    for key in extra:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(
                f"chat_template_kwargs may not set {key!r} (a field or argument of its own)",
                f"chat_template_kwargs.{key}",
                "invalid_value",
            )
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
        extra.setdefault("enable_thinking", req.reasoning_effort != "none")
    return extra


def chat_prompt_ids(
    ctx: ServingContext, req: ChatCompletionRequest, plan: tools.ToolPlan
) -> list[int]:
    """The prompt ids of a chat request: its messages through the chat template (with its
    documents and template variables), a BOS first when `add_special_tokens` asks and the
    template put none there."""
    if ctx.tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    if req.continue_final_message:
        if req.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
                "invalid_value",
            )
        if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
                "conflicting_fields",
            )
    extra = template_kwargs(req)
    try:
        ids = ctx.tokenizer.apply_chat_template(
            tools.template_messages(req, plan),
            tools=tools.template_tools(plan),
            documents=req.documents,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=True,
            return_dict=False,
            **extra,
        )
    except Exception as exc:  # template errors (e.g. role order) are the client's to fix
        raise bad_request(
            f"messages cannot be formatted by the chat template: {exc}", "messages"
        ) from exc
    if isinstance(ids, Mapping):  # a BatchEncoding, from versions that ignore return_dict
        ids = ids["input_ids"]
    prompt: list[int] = list(ids)  # type: ignore[arg-type]  # one conversation: one id list
    bos = ctx.tokenizer.bos_token_id
    if req.add_special_tokens and adds_bos(ctx.tokenizer) and prompt[:1] != [bos]:
        prompt = [bos, *prompt]
    return prompt


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    check_ids(ctx, req.tokens, "tokens")
    text = ctx.tokenizer.decode(req.tokens)
    assert isinstance(text, str)  # one id list decodes to one string
    return {"prompt": text}


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """What a client needs to tokenize as the server does: the special tokens, whether a BOS is
    added, the chat template and the context length."""
    tok = ctx.tokenizer
    template = tok.chat_template
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "add_bos_token": adds_bos(tok),
        "vocab_size": ctx.vocab_size,
        "model_max_length": ctx.max_model_len,
        "chat_template": template if isinstance(template, str) else None,
    }
