"""The request models and DecodingParams declare the same decoding fields with the same defaults.

A field added to one side only, or a default changed on one side, fails here.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from decoding import DecodingParams
from server.api.extension_fields import FIELDS
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.request_params import CONVERTED_FIELDS, PASSED_AS_IS, decoding_params
from server.api.serving import GUIDED_FIELDS, ServingContext
from server.config import ServerConfig
from server.engine.client import KVCapacity

PARAMS_DEFAULTS = {
    f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for f in dataclasses.fields(DecodingParams)
}
# Request fields of both endpoints that are no decoding parameter: bad_words feeds bad_words_ids;
# the structured output fields become the request's constraint (server/api/structured.py); the
# prompt's tokens (truncation, special tokens), the response's shape and id, and the fields that
# change nothing (server/api/extension_fields.py) are the front end's.
NOT_PARAMS = {
    "model",
    "stream",
    "stream_options",
    "bad_words",
    "response_format",
    "structured_outputs",
    *GUIDED_FIELDS,
    "use_beam_search",
    "truncate_prompt_tokens",
    "truncation_side",
    "add_special_tokens",
    "return_token_ids",
    "request_id",
    *(f.name for f in FIELDS if f.status == "no effect" and "." not in f.name),
}
# Fields of each endpoint's own.
ENDPOINT_FIELDS = {
    # max_tokens: also 0 here; src_lang / tgt_lang: translation models' source and forced token
    CompletionRequest: {"prompt", "echo", "logprobs", "suffix", "src_lang", "tgt_lang"},
    ChatCompletionRequest: {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "add_generation_prompt",
        "continue_final_message",
        "echo",
        "documents",
        "chat_template_kwargs",
        "reasoning_effort",
        "include_reasoning",
    },
}
ENDPOINTS = (CompletionRequest, ChatCompletionRequest)


def test_every_params_field_is_passed_as_is_or_converted() -> None:
    assert set(CONVERTED_FIELDS) <= set(PARAMS_DEFAULTS)
    assert set(PASSED_AS_IS) == set(PARAMS_DEFAULTS) - set(CONVERTED_FIELDS)


@pytest.mark.parametrize("model", ENDPOINTS)
@pytest.mark.parametrize("name", PASSED_AS_IS)
def test_a_field_passed_as_is_has_the_same_default_on_both_sides(name: str, model: type) -> None:
    assert name in model.model_fields, f"{name} is a DecodingParams field only"
    assert model.model_fields[name].get_default() == PARAMS_DEFAULTS[name]


@pytest.mark.parametrize("model", ENDPOINTS)
def test_the_request_declares_no_decoding_field_that_params_lacks(model: type) -> None:
    request_side = set(model.model_fields) - set(PASSED_AS_IS) - set(CONVERTED_FIELDS)
    assert request_side <= NOT_PARAMS | ENDPOINT_FIELDS[model]
    assert ENDPOINT_FIELDS[model] <= set(model.model_fields)


def context(**config: Any) -> ServingContext:
    engine = SimpleNamespace(
        kv_capacity=KVCapacity(num_blocks=64, block_size=16), eos_token_ids=frozenset({2})
    )
    return ServingContext(
        engine=engine,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        model_name="m",
        max_model_len=512,
        vocab_size=1000,
        config=ServerConfig(**config),
    )


def test_a_bare_completion_request_gets_the_default_params() -> None:
    req = CompletionRequest(prompt="hi")
    assert decoding_params(context(), req, 10, req.max_tokens or 16, req.logprobs) == (
        DecodingParams()
    )


def test_a_bare_chat_request_gets_the_default_params_but_max_tokens() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = decoding_params(context(), req, 10, None, None)
    assert params == DecodingParams(max_tokens=502)  # the rest of max_model_len 512


def test_converted_fields_reach_params() -> None:
    req = CompletionRequest(
        prompt="hi",
        stop="x",
        stop_token_ids=[3],
        logit_bias={"7": 1.5},
        bad_words_ids=[[4, 5]],
        temperature=0.5,
        logprobs=2,
    )
    params = decoding_params(context(), req, 10, 8, req.logprobs)
    assert params == DecodingParams(
        max_tokens=8,
        temperature=0.5,
        stop=("x",),
        stop_token_ids=(3,),
        logit_bias={7: 1.5},
        bad_words_ids=((4, 5),),
        logprobs=2,
    )
