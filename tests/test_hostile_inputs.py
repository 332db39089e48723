"""Hostile requests: every bad body, header or path gets a 4xx in OpenAI's error shape, never a 500.

One table of cases, each with its expected status (and `param`/`code` where the API defines them).
After every case the engine is idle with a full KV pool, and the server still answers a fixed
greedy request with exactly the text it gave before the first hostile request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from server.config import ServerConfig
from tests.conftest import make_engine, serving_context
from tests.reliability_helpers import (
    PROBE,
    assert_openai_error,
    completion_text,
    sse_payloads,
    wait_until_idle,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BODY_LIMIT = 64 * 1024  # the app under test refuses bodies above this (413)
KEYS = ("key-one", "key-two")
MAX_MODEL_LEN = 512  # the tiny llama model's context (max_position_embeddings)
VOCAB = 384  # the tiny tokenizer's vocabulary


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    status: int | tuple[int, ...]
    param: str | None = None
    code: str | None = None
    body: bytes | None = None
    content_type: str | None = "application/json"
    method: str = "POST"
    path: str = COMPLETIONS
    headers: tuple[tuple[str, str | bytes], ...] = ()
    message_contains: tuple[str, ...] = ()
    check: Callable[[httpx.Response], None] | None = None
    secured: bool = False  # against the app with API keys


def encode(obj: Any) -> bytes:
    """JSON as a client would send it; ensure_ascii keeps lone surrogates as valid \\uXXXX escapes
    and NaN/Infinity become the (non-standard) literals Python's json accepts."""
    return json.dumps(obj).encode()


def comp(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def case(
    id: str,
    group: str,
    body: Any,
    status: int | tuple[int, ...] = 400,
    param: str | None = None,
    code: str | None = None,
    **kw: Any,
) -> Case:
    raw = body if isinstance(body, bytes) or body is None else encode(body)
    return Case(id=id, group=group, status=status, param=param, code=code, body=raw, **kw)


# ---- wrong types for every field -----------------------------------------------------------------
WRONG_TYPES: dict[str, list[Any]] = {
    "model": [5, ["tiny"]],
    "max_tokens": ["ten", [2], {"n": 2}, 2.5],
    "temperature": ["hot", [0.5], {}],
    "top_p": ["most", [1]],
    "top_k": ["few", 2.5],
    "n": ["one", 1.5],
    "stream": ["maybe", 2, [True]],
    "stream_options": ["x", [1]],
    "stop": [5, [1, 2], {"a": "b"}],
    "stop_token_ids": ["x", [1.5], 3, [[1]]],
    "ignore_eos": ["sure", 3],
    "seed": ["s", 1.5, [1]],
    "user": [{"a": 1}, 5],
    "echo": ["loud", 2],
    "logprobs": ["many", 1.5],
    "best_of": ["b", 2.5],
    "min_p": ["x"],
    "typical_p": ["x"],
    "repetition_penalty": ["x"],
    "presence_penalty": ["x"],
    "frequency_penalty": [[0.5]],
    "no_repeat_ngram_size": ["x", 1.5],
    "min_tokens": ["x"],
    "logit_bias": ["x", [1, 2], {"5": "big"}],
    "bad_words": ["x", [1]],
    "bad_words_ids": ["x", [1, 2], [["a"]]],
    "num_beams": ["x", 2.5],
    "num_beam_groups": ["x"],
    "diversity_penalty": ["x"],
    "length_penalty": ["x"],
    "early_stopping": ["sometimes", 2],
    "do_sample": ["maybe", 2],
}
NEW_FIELDS = {
    "min_p",
    "typical_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "no_repeat_ngram_size",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "bad_words_ids",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "length_penalty",
    "early_stopping",
    "do_sample",
    "best_of",
    "logprobs",
    "echo",
}


def wrong_type_cases() -> Iterator[Case]:
    for name, values in WRONG_TYPES.items():
        for i, value in enumerate(values):
            yield case(
                f"type-{name}-{i}", "wrong_types", comp(**{name: value}), 400, name, "invalid_value"
            )
    chat_wrong = {
        "max_completion_tokens": ["x", 1.5],
        "logprobs": ["often", 2],
        "top_logprobs": ["x"],
        "temperature": ["x"],
        "n": [[2]],
        "stop": [7],
    }
    for name, values in chat_wrong.items():
        for i, value in enumerate(values):
            yield case(
                f"chat-type-{name}-{i}",
                "wrong_types",
                chat(**{name: value}),
                400,
                name,
                "invalid_value",
                path=CHAT,
            )


# Lax coercions pydantic performs but OpenAI's API refuses ("expected an integer, but got a
# boolean").
COERCIONS = [
    case("bool-max_tokens", "coercions", comp(max_tokens=True), 400, "max_tokens"),
    case("bool-token-ids", "coercions", {"prompt": [True, 2], "max_tokens": 2}, 400, "prompt"),
    case("string-temperature", "coercions", comp(temperature="0.5"), 400, "temperature"),
    case("string-stream", "coercions", comp(stream="yes"), 400, "stream"),
]

NAN, INF = float("nan"), float("inf")
RANGES = [
    case(
        "temperature-negative", "ranges", comp(temperature=-1), 400, "temperature", "invalid_value"
    ),
    case(
        "temperature-above-2", "ranges", comp(temperature=2.5), 400, "temperature", "invalid_value"
    ),
    case("temperature-nan", "ranges", comp(temperature=NAN), 400, "temperature"),
    case("temperature-inf", "ranges", comp(temperature=INF), 400, "temperature"),
    case("top_p-zero", "ranges", comp(top_p=0), 400, "top_p", "invalid_value"),
    case("top_p-above-1", "ranges", comp(top_p=1.5), 400, "top_p", "invalid_value"),
    case("top_p-negative", "ranges", comp(top_p=-0.1), 400, "top_p", "invalid_value"),
    case("top_p-nan", "ranges", comp(top_p=NAN), 400, "top_p"),
    case("top_k-negative", "ranges", comp(top_k=-2), 400, "top_k", "invalid_value"),
    case(
        "chat-max_tokens-zero",
        "ranges",
        chat(max_tokens=0),
        400,
        "max_tokens",
        "invalid_value",
        path=CHAT,
    ),
    case("max_tokens-negative", "ranges", comp(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    case(
        "max_tokens-inf-literal",
        "ranges",
        b'{"prompt": "Hi", "max_tokens": 1e400}',
        400,
        "max_tokens",
    ),
    case("n-zero", "ranges", comp(n=0), 400, "n", "invalid_value"),
    case("best_of-zero", "ranges", comp(best_of=0), 400, "best_of", "invalid_value"),
    case("num_beams-zero", "ranges", comp(num_beams=0), 400, "num_beams", "invalid_value"),
    case("num_beam_groups-zero", "ranges", comp(num_beam_groups=0), 400, "num_beam_groups"),
    case("seed-negative", "ranges", comp(seed=-1), 400, "seed", "invalid_value"),
    case("seed-2**64", "ranges", comp(seed=2**64), 400, "seed", "invalid_value"),
    case("min_p-negative", "ranges", comp(min_p=-0.1), 400, "min_p", "invalid_value"),
    case("min_p-above-1", "ranges", comp(min_p=1.1), 400, "min_p", "invalid_value"),
    case("min_p-nan", "ranges", comp(min_p=NAN), 400, "min_p"),
    case("typical_p-zero", "ranges", comp(typical_p=0), 400, "typical_p", "invalid_value"),
    case("typical_p-above-1", "ranges", comp(typical_p=1.5), 400, "typical_p"),
    case(
        "repetition_penalty-zero", "ranges", comp(repetition_penalty=0), 400, "repetition_penalty"
    ),
    case(
        "repetition_penalty-nan", "ranges", comp(repetition_penalty=NAN), 400, "repetition_penalty"
    ),
    case("presence_penalty-above", "ranges", comp(presence_penalty=2.5), 400, "presence_penalty"),
    case(
        "presence_penalty-minus-inf", "ranges", comp(presence_penalty=-INF), 400, "presence_penalty"
    ),
    case("frequency_penalty-below", "ranges", comp(frequency_penalty=-3), 400, "frequency_penalty"),
    case(
        "no_repeat_ngram_size-negative",
        "ranges",
        comp(no_repeat_ngram_size=-1),
        400,
        "no_repeat_ngram_size",
    ),
    case("min_tokens-negative", "ranges", comp(min_tokens=-1), 400, "min_tokens"),
    case("logit_bias-above-100", "ranges", comp(logit_bias={"5": 101}), 400, "logit_bias"),
    case("logit_bias-nan", "ranges", comp(logit_bias={"5": NAN}), 400, "logit_bias"),
    case("logit_bias-negative-key", "ranges", comp(logit_bias={"-1": 1}), 400, "logit_bias"),
    case("logit_bias-word-key", "ranges", comp(logit_bias={"abc": 1}), 400, "logit_bias"),
    case("logit_bias-float-key", "ranges", comp(logit_bias={"1.5": 1}), 400, "logit_bias"),
    case("logit_bias-out-of-vocab", "ranges", comp(logit_bias={str(10**6): 1}), 400, "logit_bias"),
    case("bad_words_ids-empty-word", "ranges", comp(bad_words_ids=[[]]), 400, "bad_words_ids"),
    case("bad_words_ids-negative", "ranges", comp(bad_words_ids=[[-1]]), 400, "bad_words_ids"),
    case(
        "bad_words_ids-out-of-vocab", "ranges", comp(bad_words_ids=[[VOCAB]]), 400, "bad_words_ids"
    ),
    case("bad_words-empty-string", "ranges", comp(bad_words=[""]), 400, "bad_words"),
    case(
        "diversity_penalty-negative",
        "ranges",
        comp(num_beams=2, num_beam_groups=2, diversity_penalty=-1),
        400,
        "diversity_penalty",
    ),
    case(
        "length_penalty-nan", "ranges", comp(num_beams=2, length_penalty=NAN), 400, "length_penalty"
    ),
    case(
        "length_penalty-inf", "ranges", comp(num_beams=2, length_penalty=INF), 400, "length_penalty"
    ),
    case("logprobs-negative", "ranges", comp(logprobs=-1), 400, "logprobs", "invalid_value"),
    case(
        "chat-max_completion_tokens-zero",
        "ranges",
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
        "invalid_value",
        path=CHAT,
    ),
    case(
        "chat-top_logprobs-negative",
        "ranges",
        chat(logprobs=True, top_logprobs=-1),
        400,
        "top_logprobs",
        path=CHAT,
    ),
]

COMBINATIONS = [
    case(
        "beams-not-divisible-by-groups",
        "combinations",
        comp(num_beams=4, num_beam_groups=3),
        400,
        "num_beam_groups",
    ),
    case("groups-without-beams", "combinations", comp(num_beam_groups=2), 400, "num_beam_groups"),
    case(
        "diversity-without-groups",
        "combinations",
        comp(num_beams=2, diversity_penalty=0.5),
        400,
        "diversity_penalty",
    ),
    case(
        "group-beams-do-sample",
        "combinations",
        comp(num_beams=4, num_beam_groups=2, do_sample=True),
        400,
        "do_sample",
    ),
    case("n-above-best_of", "combinations", comp(n=3, best_of=2), 400, "best_of"),
    case("best_of-greedy", "combinations", comp(best_of=2, temperature=0), 400, "best_of"),
    case("n-above-num_beams", "combinations", comp(num_beams=2, n=4), 400, "n"),
    case("best_of-with-beams", "combinations", comp(num_beams=2, best_of=3), 400, "best_of"),
    case(
        "do_sample-temperature-0",
        "combinations",
        comp(do_sample=True, temperature=0),
        400,
        "temperature",
    ),
    case(
        "min_tokens-above-max_tokens",
        "combinations",
        comp(min_tokens=10, max_tokens=2),
        400,
        "min_tokens",
    ),
    case("max_tokens-zero-with-n", "combinations", comp(max_tokens=0, n=2), 400, "max_tokens"),
    case(
        "prompt_logprobs-above-cap",
        "ranges",
        comp(prompt_logprobs=21),
        400,
        "prompt_logprobs",
        "above_limit",
    ),
    case(
        "chat-top_logprobs-without-logprobs",
        "combinations",
        chat(top_logprobs=2),
        400,
        "top_logprobs",
        path=CHAT,
    ),
]

CAPS = [  # server defaults: max_n = max_best_of = max_num_beams = 16, max_logprobs = 20
    case("n-17", "caps", comp(n=17), 400, "n"),
    case("n-huge", "caps", comp(n=10**6), 400, "n"),
    case("n-2**70", "caps", comp(n=2**70), 400, "n"),
    case("best_of-huge", "caps", comp(best_of=10**6), 400, "best_of"),
    case("num_beams-huge", "caps", comp(num_beams=10**6), 400, "num_beams"),
    case(
        "num_beams-huge-groups",
        "caps",
        comp(num_beams=10**6, num_beam_groups=10**3),
        400,
        "num_beams",
    ),
    case("logprobs-21", "caps", comp(logprobs=21), 400, "logprobs"),
    case("logprobs-huge", "caps", comp(logprobs=10**9), 400, "logprobs"),
    case(
        "chat-top_logprobs-huge",
        "caps",
        chat(logprobs=True, top_logprobs=10**6),
        400,
        "top_logprobs",
        path=CHAT,
    ),
    case("chat-n-huge", "caps", chat(n=10**6), 400, "n", path=CHAT),
    case("stop-17", "caps", comp(stop=["a"] * 17), 400, "stop", "too_many_stop"),
    case(
        "prompts-17",
        "caps",
        {"prompt": ["Hi"] * 17, "max_tokens": 1},
        400,
        "prompt",
        "too_many_prompts",
    ),
    case(
        "max_tokens-huge",
        "caps",
        comp(max_tokens=10**30),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    case(
        "context-names-both-numbers",
        "caps",
        {"prompt": "Hello world", "max_tokens": 600},
        400,
        "max_tokens",
        "context_length_exceeded",
        message_contains=(str(MAX_MODEL_LEN), "600"),
    ),
    case(
        "prompt-longer-than-context",
        "caps",
        {"prompt": "x " * 600},
        400,
        "prompt",
        "context_length_exceeded",
        message_contains=(str(MAX_MODEL_LEN),),
    ),
    case(
        "chat-max_completion_tokens-huge",
        "caps",
        chat(max_completion_tokens=10**6),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
        path=CHAT,
    ),
]

MODELS = [
    case("model-unknown", "models", comp(model="gpt-4"), 404, "model", "model_not_found"),
    case("model-empty", "models", comp(model=""), 404, "model", "model_not_found"),
    case("model-other-case", "models", comp(model="TINY"), 404, "model", "model_not_found"),
    case("model-lone-surrogate", "models", comp(model="\ud800"), 404, "model", "model_not_found"),
    case("model-served", "models", comp(model="tiny"), 200),
]

PROMPTS = [
    case("prompt-empty-string", "prompts", {"prompt": ""}, 400, "prompt", "empty_prompt"),
    case("prompt-empty-list", "prompts", {"prompt": []}, 400, "prompt", "empty_prompt"),
    case("prompt-list-of-empty-list", "prompts", {"prompt": [[]]}, 400, "prompt", "empty_prompt"),
    case(
        "prompt-one-empty-of-two", "prompts", {"prompt": ["a", ""]}, 400, "prompt", "empty_prompt"
    ),
    case(
        "prompt-one-empty-token-list",
        "prompts",
        {"prompt": [[1, 2], []]},
        400,
        "prompt",
        "empty_prompt",
    ),
    case("prompt-missing", "prompts", {"max_tokens": 2}, 400, "prompt"),
    case("prompt-null", "prompts", {"prompt": None}, 400, "prompt"),
    case("prompt-object", "prompts", {"prompt": {"text": "x"}}, 400, "prompt"),
    case("prompt-number", "prompts", {"prompt": 5}, 400, "prompt"),
    case("prompt-mixed-list", "prompts", {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    case("prompt-float-token", "prompts", {"prompt": [1.5]}, 400, "prompt"),
    case("prompt-negative-token", "prompts", {"prompt": [5, -2]}, 400, "prompt"),
    case(
        "prompt-token-at-vocab-size", "prompts", {"prompt": [VOCAB]}, 400, "prompt", "invalid_token"
    ),
    case("prompt-token-huge", "prompts", {"prompt": [10**30]}, 400, "prompt", "invalid_token"),
    case(
        "prompt-nested-token-out-of-vocab",
        "prompts",
        {"prompt": [[5], [10**6]]},
        400,
        "prompt",
        "invalid_token",
    ),
    case("prompt-lone-surrogate", "prompts", comp(prompt="\ud800"), 400, "prompt"),
    case("prompt-lone-surrogate-in-list", "prompts", comp(prompt=["a", "x\udfffy"]), 400, "prompt"),
    case("prompt-emoji-cjk", "prompts", comp(prompt="😀 東京 café ✓ naïve"), 200),
    case("prompt-rtl-zero-width", "prompts", comp(prompt="\u202eabc\u200d\u200e\u2066x"), 200),
    case("prompt-control-chars", "prompts", comp(prompt="\x00\x01\x1b[31m\x7f\r\n\t"), 200),
    case("prompt-combining-marks", "prompts", comp(prompt="a" + "\u0301" * 200), 200),
    case("prompt-nonchars", "prompts", comp(prompt="\ufffd\uffff\ufffe\U0010ffff"), 200),
    case("prompt-special-token-text", "prompts", comp(prompt="<eos><bos><pad><unk><|user|>"), 200),
    case("prompt-special-token-ids", "prompts", comp(prompt=[0, 1, 2, 3]), 200),
    case("prompt-16-prompts", "prompts", {"prompt": ["Hi"] * 16, "max_tokens": 1}, 200),
]

STOPS = [
    case("stop-empty-string", "stops", comp(stop=""), 400, "stop"),
    case("stop-list-with-empty", "stops", comp(stop=["a", ""]), 400, "stop"),
    case(
        "stop-token-id-out-of-vocab", "stops", comp(stop_token_ids=[VOCAB]), 400, "stop_token_ids"
    ),
    case("stop-token-id-negative", "stops", comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    case("stop-token-id-huge", "stops", comp(stop_token_ids=[10**30]), 400, "stop_token_ids"),
    case("stop-very-long", "stops", comp(stop=["x" * 20_000], max_tokens=4), 200),
    case(
        "stop-very-long-streamed",
        "stops",
        comp(stop=["y" * 20_000, "z" * 10_000], max_tokens=4, stream=True),
        200,
    ),
    case(
        "stop-16-long",
        "stops",
        comp(stop=[str(i) * 1000 for i in range(16)], max_tokens=4, stream=True),
        200,
    ),
    case(
        "stop-unicode", "stops", comp(stop=["😀", "東", "\u0301"], max_tokens=4, stream=True), 200
    ),
    case("stop-control-chars", "stops", comp(stop=["\x00", "\n", "\x1b"], max_tokens=4), 200),
    case("stop-lone-surrogate", "stops", comp(stop=["\ud800"], max_tokens=2), (200, 400)),
    case("stop-every-byte", "stops", comp(stop=[chr(c) for c in range(32, 48)], max_tokens=4), 200),
]

CHAT_CASES = [
    case("chat-messages-missing", "chat", {"max_tokens": 2}, 400, "messages", path=CHAT),
    case("chat-messages-empty", "chat", {"messages": []}, 400, "messages", path=CHAT),
    case("chat-messages-string", "chat", {"messages": "hi"}, 400, "messages", path=CHAT),
    case("chat-messages-null-entry", "chat", {"messages": [None]}, 400, "messages", path=CHAT),
    case("chat-role-missing", "chat", {"messages": [{"content": "x"}]}, 400, "messages", path=CHAT),
    case(
        "chat-role-unknown",
        "chat",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-role-number",
        "chat",
        {"messages": [{"role": 5, "content": "x"}]},
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-content-number",
        "chat",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-content-image-part",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-content-part-without-text",
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-content-lone-surrogate",
        "chat",
        chat(messages=[{"role": "user", "content": "\udc80"}]),
        400,
        "messages",
        path=CHAT,
    ),
    case(
        "chat-unknown-model",
        "chat",
        chat(model="gpt-4o"),
        404,
        "model",
        "model_not_found",
        path=CHAT,
    ),
    case(
        "chat-prompt-too-long",
        "chat",
        chat(messages=[{"role": "user", "content": "x " * 600}]),
        400,
        "messages",
        "context_length_exceeded",
        path=CHAT,
    ),
    case(  # as OpenAI: a user message needs content (an assistant's may be tool_calls only)
        "chat-content-null",
        "chat",
        chat(messages=[{"role": "user", "content": None}]),
        400,
        "messages.0.content",
        "missing_required_parameter",
        path=CHAT,
    ),
    case(
        "chat-text-parts",
        "chat",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        ),
        200,
        path=CHAT,
    ),
    case(
        "chat-template-injection",
        "chat",
        chat(
            messages=[
                {"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}"}
            ]
        ),
        200,
        path=CHAT,
    ),
    case(
        "chat-many-messages",
        "chat",
        chat(messages=[{"role": ("user", "assistant")[i % 2], "content": "Hi"} for i in range(40)]),
        200,
        path=CHAT,
    ),
    case(
        "chat-streamed-unicode",
        "chat",
        chat(messages=[{"role": "user", "content": "😀\x00東"}], stream=True),
        200,
        path=CHAT,
    ),
]


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


RAW_BODIES = [
    case("raw-truncated", "raw_bodies", b'{"prompt": "x",', 400, None, "invalid_json"),
    case("raw-trailing-comma", "raw_bodies", b'{"prompt": "x",}', 400, None, "invalid_json"),
    case("raw-trailing-garbage", "raw_bodies", b'{"prompt": "x"} xyz', 400),
    case("raw-single-quotes", "raw_bodies", b"{'prompt': 'x'}", 400),
    case("raw-null", "raw_bodies", b"null", 400),
    case("raw-array", "raw_bodies", b"[1, 2]", 400),
    case("raw-string", "raw_bodies", b'"prompt"', 400),
    case("raw-number", "raw_bodies", b"123", 400),
    case("raw-true", "raw_bodies", b"true", 400),
    case("raw-empty", "raw_bodies", b"", 400),
    case("raw-whitespace", "raw_bodies", b" \n\t ", 400),
    case("raw-nul-byte", "raw_bodies", b"\x00", 400),
    case("raw-trailing-nul", "raw_bodies", b'{"prompt": "x"}\x00', 400),
    case("raw-invalid-utf8", "raw_bodies", b"\xff\xfe\xfd", 400),
    case("raw-invalid-utf8-in-string", "raw_bodies", b'{"prompt": "\xff\xc0"}', 400),
    case("raw-overlong-utf8", "raw_bodies", b'{"prompt": "\xc0\xaf"}', 400),
    case("raw-deeply-nested-array", "raw_bodies", _deep(30_000), 400),
    case("raw-deeply-nested-prompt", "raw_bodies", b'{"prompt": ' + _deep(30_000) + b"}", 400),
    case("raw-nested-objects", "raw_bodies", b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400),
    case(
        "raw-moderately-nested-prompt",
        "raw_bodies",
        b'{"prompt": ' + _deep(60) + b"}",
        400,
        "prompt",
    ),
    case(
        "raw-huge-integer",
        "raw_bodies",
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
    ),
    case(
        "raw-huge-exponent",
        "raw_bodies",
        b'{"prompt": "x", "temperature": 1e999999}',
        400,
        "temperature",
    ),
    case("raw-nan-literal", "raw_bodies", b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    case(
        "raw-infinity-literal",
        "raw_bodies",
        b'{"prompt": "x", "max_tokens": -Infinity}',
        400,
        "max_tokens",
    ),
    case(
        "raw-duplicate-key-last-valid",
        "raw_bodies",
        b'{"prompt": "x", "max_tokens": 0, "max_tokens": 2}',
        200,
    ),
    case(
        "raw-duplicate-key-last-invalid",
        "raw_bodies",
        b'{"prompt": "x", "max_tokens": 2, "max_tokens": -1}',
        400,
        "max_tokens",
    ),
    case("raw-bom-utf8", "raw_bodies", b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}', (200, 400)),
    case(
        "raw-utf16", "raw_bodies", '{"prompt": "x", "max_tokens": 1}'.encode("utf-16"), (200, 400)
    ),
    case(
        "raw-long-unknown-key",
        "raw_bodies",
        encode({"k" * 30_000: 1, "prompt": "x", "max_tokens": 1}),
        400,
        code="unknown_field",
    ),
    case(
        "raw-many-unknown-keys",
        "raw_bodies",
        encode({**{f"k{i}": i for i in range(3000)}, "prompt": "x", "max_tokens": 1}),
        400,
        param="k0",
        code="unknown_field",
    ),
]

CONTENT_TYPES = [
    # not read as JSON (browsers send these cross-site unasked): a 400 naming the header
    case(
        "ct-text-plain",
        "content_types",
        encode(comp()),
        400,
        content_type="text/plain",
        code="invalid_content_type",
    ),
    case(
        "ct-form-json",
        "content_types",
        encode(comp()),
        400,
        content_type="application/x-www-form-urlencoded",
        code="invalid_content_type",
    ),  # curl -d without -H
    case(
        "ct-none-json",
        "content_types",
        encode(comp()),
        400,
        content_type=None,
        code="invalid_content_type",
    ),
    case(
        "ct-form",
        "content_types",
        b"prompt=Hi&max_tokens=2",
        400,
        content_type="application/x-www-form-urlencoded",
    ),
    case(
        "ct-multipart",
        "content_types",
        b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nHi\r\n--x--',
        400,
        content_type="multipart/form-data; boundary=x",
    ),
    case("ct-xml", "content_types", b"<prompt>Hi</prompt>", 400, content_type="application/xml"),
    case("ct-garbage", "content_types", encode(comp()), 400, content_type="garbage"),
    case(
        "ct-octet-stream",
        "content_types",
        encode(comp()),
        400,
        content_type="application/octet-stream",
    ),
    case(
        "ct-json-suffix",
        "content_types",
        encode(comp()),
        200,
        content_type="application/vnd.api+json",
    ),
    case(
        "ct-json-charset",
        "content_types",
        encode(comp()),
        200,
        content_type="application/json; charset=utf-8",
    ),
    case(
        "ct-json-bad-charset",
        "content_types",
        encode(comp()),
        (200, 400, 415),
        content_type="application/json; charset=ebcdic",
    ),
]


SIZES = [
    case(
        "size-over-limit",
        "sizes",
        encode({"prompt": "x" * (BODY_LIMIT + 1)}),
        413,
        None,
        "body_too_large",
    ),
    case(
        "size-over-limit-chat",
        "sizes",
        encode(chat(messages=[{"role": "user", "content": "x" * BODY_LIMIT}])),
        413,
        None,
        "body_too_large",
        path=CHAT,
    ),
    case(
        "size-content-length-not-a-number",
        "sizes",
        encode(comp()),
        (400, 413),
        headers=(("content-length", "abc"),),
    ),
    case(
        "size-content-length-negative",
        "sizes",
        encode(comp()),
        (400, 413),
        headers=(("content-length", "-1"),),
    ),
    case(
        "size-content-length-huge",
        "sizes",
        encode(comp()),
        413,
        headers=(("content-length", "9" * 30),),
    ),
    case("size-many-stop-strings-over-limit", "sizes", encode(comp(stop=["s" * 5000] * 16)), 413),
    case(
        "size-just-under-limit-too-long-prompt",
        "sizes",
        encode({"prompt": "x " * 30_000}),
        400,
        "prompt",
        "context_length_exceeded",
    ),
]


def _assert_request_id_replaced(r: httpx.Response) -> None:
    given = dict(HEADER_CASES_IDS)
    rid = r.headers["x-request-id"]
    assert rid not in given.values() and 1 <= len(rid) <= 128 and rid.isalnum(), rid


HEADER_CASES_IDS = [
    ("x-request-id", "../../etc/passwd"),
    ("x-request-id", "a" * 500),
    ("x-request-id", "id with spaces"),
    ("x-request-id", "é".encode()),
]

HEADERS = [
    *[
        case(
            f"header-bad-request-id-{i}",
            "headers",
            encode(comp()),
            200,
            headers=((k, v),),
            check=_assert_request_id_replaced,
        )
        for i, (k, v) in enumerate(HEADER_CASES_IDS)
    ],
    case(
        "header-auth-garbage-without-keys",
        "headers",
        encode(comp()),
        200,
        headers=(("authorization", "Bearer \x7f" + "z" * 4000),),
    ),
    case(
        "header-huge-cookie",
        "headers",
        encode(comp()),
        200,
        headers=(("cookie", "c=" + "v" * 12_000),),
    ),
    case(
        "header-content-encoding-gzip-lie",
        "headers",
        encode(comp()),
        (200, 400, 415),
        headers=(("content-encoding", "gzip"),),
    ),
    case(
        "header-expect-continue",
        "headers",
        encode(comp()),
        200,
        headers=(("expect", "100-continue"),),
    ),
    case(
        "header-many-headers",
        "headers",
        encode(comp()),
        200,
        headers=tuple((f"x-h{i}", "v") for i in range(300)),
    ),
]

PATHS = [
    case("path-get-completions", "paths", None, 405, method="GET"),
    case("path-put-completions", "paths", encode(comp()), 405, method="PUT"),
    case("path-delete-chat", "paths", None, 405, method="DELETE", path=CHAT),
    case("path-patch-chat", "paths", encode(chat()), 405, method="PATCH", path=CHAT),
    case("path-post-models", "paths", encode(comp()), 405, path="/v1/models"),
    case("path-post-stats", "paths", encode(comp()), 405, path="/v1/engine/stats"),
    case("path-unknown", "paths", encode(comp()), 404, path="/v1/nothing"),
    case("path-very-long", "paths", None, 404, method="GET", path="/" + "a" * 8000),
    case("path-encoded-nul", "paths", encode(comp()), 404, path="/v1/completions%00"),
    case("path-traversal", "paths", None, 404, method="GET", path="/%2e%2e/%2e%2e/etc/passwd"),
    case("path-model-by-id", "paths", None, 404, method="GET", path="/v1/models/tiny/../../../x"),
    case(
        "path-query-string-ignored",
        "paths",
        encode(comp()),
        200,
        path=COMPLETIONS + "?stream=true&n=99",
    ),
]

SECURED = [  # hostile Authorization spellings not already in test_guards.py
    case(
        f"auth-{name}",
        "auth",
        encode(comp()),
        401,
        None,
        "invalid_api_key",
        headers=headers,
        secured=True,
    )
    for name, headers in [
        ("upper-case-key", (("authorization", "Bearer KEY-ONE"),)),
        ("tab-separator", (("authorization", "Bearer\tkey-one"),)),
        ("two-keys", (("authorization", "Bearer key-one key-two"),)),
        ("comma-keys", (("authorization", "Bearer key-one,key-two"),)),
        ("huge-token", (("authorization", "Bearer " + "k" * 20_000),)),
        ("non-ascii-token", (("authorization", "Bearer kéy-one".encode()),)),
        ("x-api-key-header", (("x-api-key", "key-one"),)),
        ("token-scheme", (("authorization", "Token key-one"),)),
        ("key-in-cookie", (("cookie", "authorization=Bearer key-one"),)),
    ]
] + [
    case(
        "auth-key-in-query",
        "auth",
        encode(comp()),
        401,
        None,
        "invalid_api_key",
        path=COMPLETIONS + "?api_key=key-one",
        secured=True,
    ),
    case(
        "auth-good-key-hostile-body",
        "auth",
        b"\xff",
        400,
        headers=(("authorization", "Bearer key-two"),),
        secured=True,
    ),
]


# ---- structured outputs: hostile schemas, regexes and grammars -----------------------------------
def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _schema_format(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


SCHEMA_PARAM = "response_format.json_schema.schema"
REGEX_PARAM = "structured_outputs.regex"
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}}
GRAMMARS = [
    case("schema-nested-400", "grammars", comp(**_schema_format(_nested_schema(400))), 400,
         SCHEMA_PARAM, "invalid_grammar"),
    case("schema-nested-40", "grammars", comp(**_schema_format(_nested_schema(40))), 200),
    case("schema-1500-properties", "grammars", comp(**_schema_format(WIDE)), 200),
    case("schema-enum-4000", "grammars",
         comp(**_schema_format({"enum": [f"v{i}" for i in range(4000)]})), 200),
    case("schema-min-over-max", "grammars",
         comp(**_schema_format({"type": "string", "minLength": 5, "maxLength": 2})), 400,
         SCHEMA_PARAM, "invalid_grammar"),
    case("schema-no-type-fits", "grammars",
         comp(**_schema_format({"allOf": [{"type": "string"}, {"type": "integer"}]})), 400,
         SCHEMA_PARAM, "invalid_grammar"),
    case("schema-empty-enum", "grammars", comp(**_schema_format({"enum": []})), 400,
         SCHEMA_PARAM, "invalid_grammar"),
    case("schema-self-reference", "grammars", comp(**_schema_format({"$ref": "#"})), 400,
         SCHEMA_PARAM, "invalid_grammar"),
    case("schema-remote-reference", "grammars",
         comp(**_schema_format({"$ref": "http://127.0.0.1:9/x.json"})), 400, SCHEMA_PARAM,
         "invalid_grammar"),
    case("schema-not-an-object", "grammars", comp(**_schema_format([1, 2])), 400,
         "response_format.json_schema.schema"),
    case("regex-catastrophic", "grammars", comp(structured_outputs={"regex": "(a+)+$"}), 200),
    case("regex-alternation-star", "grammars", comp(structured_outputs={"regex": "(a|aa)*b"}), 200),
    case("regex-huge-repeat", "grammars", comp(structured_outputs={"regex": "a{100000}"}), 200),
    case("regex-nested-repeats", "grammars",
         comp(structured_outputs={"regex": "((a{1,100}){1,100}){1,100}"}), 200),
    case("regex-lookaround", "grammars", comp(structured_outputs={"regex": "(?=a)a"}), 400,
         REGEX_PARAM, "invalid_grammar"),
    case("regex-backreference", "grammars", comp(structured_outputs={"regex": r"(a)\1"}), 400,
         REGEX_PARAM, "invalid_grammar"),
    case("lark-left-recursive", "grammars",
         comp(structured_outputs={"grammar": 'start: start "a" | "a"'}), (200, 400)),
    case("lark-undefined-rule", "grammars", comp(structured_outputs={"grammar": "start: nope"}),
         400, "structured_outputs.grammar", "invalid_grammar"),
    case("choice-3000", "grammars",
         comp(structured_outputs={"choice": [f"option {i}" for i in range(3000)]}), 200),
    case("tool-parameters-nested-400", "grammars",
         chat(tools=[{"type": "function", "function": {"name": "f",
                                                        "parameters": _nested_schema(400)}}],
              tool_choice="required"), 400, "messages", "context_length_exceeded", path=CHAT),
]  # fmt: skip

CASES: list[Case] = [
    *wrong_type_cases(),
    *COERCIONS,
    *RANGES,
    *COMBINATIONS,
    *CAPS,
    *MODELS,
    *PROMPTS,
    *STOPS,
    *CHAT_CASES,
    *RAW_BODIES,
    *CONTENT_TYPES,
    *SIZES,
    *HEADERS,
    *PATHS,
    *SECURED,
    *GRAMMARS,
]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
assert len(CASES) >= 100


def _last_of_each_group(cases: list[Case]) -> set[str]:
    last = {c.group: c.id for c in cases}  # later cases overwrite earlier ones of their group
    return set(last.values())


LAST_OF_GROUP = _last_of_each_group(CASES)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_ctx(tiny_model_dirs: dict[str, Path]) -> Iterator[ServingContext]:
    ctx = serving_context(make_engine(tiny_model_dirs["llama"]))
    yield ctx
    ctx.engine.shutdown()


def _client(app: Any) -> httpx.AsyncClient:
    # raise_app_exceptions=False: an unhandled exception becomes the 500 a real server would send.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30)


@pytest.fixture(scope="module")
def baseline_probe_text(hostile_ctx: ServingContext) -> str:
    """The probe's text before any hostile request."""

    async def probe() -> str:
        async with _client(create_app(ctx=hostile_ctx)) as c:
            r = await c.post(COMPLETIONS, json=PROBE)
            assert r.status_code == 200, r.text
            return completion_text(r.json())

    return asyncio.run(probe())


@pytest.fixture
async def clients(hostile_ctx: ServingContext) -> AsyncIterator[dict[bool, httpx.AsyncClient]]:
    open_app = create_app(ctx=hostile_ctx, config=ServerConfig(max_body_bytes=BODY_LIMIT))
    secured_app = create_app(
        ctx=hostile_ctx, config=ServerConfig(max_body_bytes=BODY_LIMIT, api_keys=list(KEYS))
    )
    async with _client(open_app) as plain, _client(secured_app) as secured:
        yield {False: plain, True: secured}


# ---- the test ------------------------------------------------------------------------------------
def _check_success(c: Case, r: httpx.Response) -> None:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        payloads = sse_payloads(r.text)
        assert payloads[-1] == "[DONE]", payloads[-3:]
        for p in payloads[:-1]:
            assert "error" not in json.loads(p), p
    elif c.path.startswith((COMPLETIONS, CHAT)):
        body = r.json()
        assert body["choices"] and "usage" in body, body


def _check_response(c: Case, r: httpx.Response) -> None:
    expected = (c.status,) if isinstance(c.status, int) else c.status
    assert r.status_code < 500, f"{c.id}: server error {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert_openai_error(r, expected, c.param, c.code)
        message = r.json()["error"]["message"]
        for fragment in c.message_contains:
            assert fragment in message, (fragment, message)
    else:
        assert r.status_code in expected, (r.status_code, r.text[:300])
        _check_success(c, r)
    if c.check is not None:
        c.check(r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("c", [pytest.param(c, id=f"{c.group}:{c.id}") for c in CASES])
async def test_hostile_request_gets_its_status_and_leaves_the_server_intact(
    c: Case, clients: dict[bool, httpx.AsyncClient], baseline_probe_text: str
) -> None:
    client = clients[c.secured]
    headers: dict[str, str | bytes] = dict(c.headers)
    if c.content_type is not None:
        headers.setdefault("content-type", c.content_type)
    r = await client.request(c.method, c.path, content=c.body, headers=headers)
    _check_response(c, r)
    plain = clients[False]
    await wait_until_idle(plain, timeout=5)
    if c.id not in LAST_OF_GROUP and not (200 <= r.status_code < 300):
        return  # refused before the engine: the group's last case probes the server
    probe = await plain.post(COMPLETIONS, json=PROBE)
    assert probe.status_code == 200, probe.text
    assert completion_text(probe.json()) == baseline_probe_text
    await wait_until_idle(plain, timeout=5)


def test_the_table_covers_every_group() -> None:
    groups = {c.group for c in CASES}
    assert {
        "wrong_types",
        "ranges",
        "combinations",
        "caps",
        "models",
        "prompts",
        "stops",
        "chat",
        "raw_bodies",
        "content_types",
        "sizes",
        "headers",
        "paths",
        "auth",
    } <= groups
    assert NEW_FIELDS <= set(WRONG_TYPES)
