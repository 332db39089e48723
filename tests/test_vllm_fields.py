"""vLLM's extension fields over HTTP, on the tiny model: each does what vLLM's does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from server.api.serving import ServingContext

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Hello there"}]


async def post(client: httpx.AsyncClient, path: str, **body: Any) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream(client: httpx.AsyncClient, path: str, **body: Any) -> list[dict]:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def error(client: httpx.AsyncClient, path: str, **body: Any) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


async def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(
    client: httpx.AsyncClient,
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(client, COMP, **GREEDY, max_tokens=6, stream_options=options)
    *content, last = chunks
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) == len(counts)
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {last["usage"]["prompt_tokens"]}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    for c in content:
        assert (
            c["usage"]["total_tokens"]
            == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        )
    chat = await stream(client, CHAT, messages=MESSAGES, max_tokens=4, stream_options=options)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[0]["usage"]["completion_tokens"] == 0 and chat[-1]["usage"] is not None
    plain = await stream(
        client, COMP, **GREEDY, max_tokens=3, stream_options={"include_usage": True}
    )
    assert [c["usage"] for c in plain[:-1]] == [None] * (len(plain) - 1)


@pytest.mark.parametrize("strategy", [{"temperature": 0}, {"num_beams": 2}])
async def test_include_stop_str_in_output_keeps_the_stop_string(
    client: httpx.AsyncClient, strategy: dict
) -> None:
    body = {"prompt": PROMPT, "ignore_eos": True, "max_tokens": 12, **strategy}
    full = (await post(client, COMP, **body))["choices"][0]["text"]
    stop = full[4:7]
    at = full.index(stop)
    for include, expected in ((False, full[:at]), (True, full[: at + len(stop)])):
        asked = {**body, "stop": [stop], "include_stop_str_in_output": include}
        (choice,) = (await post(client, COMP, **asked))["choices"]
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
        streamed = await stream(client, COMP, **asked)
        assert "".join(c["choices"][0]["text"] for c in streamed) == expected


async def test_a_stop_token_is_text_only_with_include_stop_str_in_output(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    ids = (await post(client, COMP, **GREEDY, max_tokens=6, return_token_ids=True))["choices"][0][
        "token_ids"
    ]
    stop_id = ids[3]
    for include in (False, True):
        body = {**GREEDY, "max_tokens": 6, "stop_token_ids": [stop_id], "return_token_ids": True}
        (choice,) = (await post(client, COMP, **body, include_stop_str_in_output=include))[
            "choices"
        ]
        shown = choice["token_ids"] if include else choice["token_ids"][:-1]
        assert choice["token_ids"][-1] == stop_id and choice["finish_reason"] == "stop"
        assert choice["text"] == tiny_ctx.tokenizer.decode(shown, skip_special_tokens=True)


async def test_no_stop_string_is_looked_for_before_min_tokens(client: httpx.AsyncClient) -> None:
    full = (await post(client, COMP, **GREEDY, max_tokens=10))["choices"][0]["text"]
    stop = next(full[:k] for k in range(1, len(full)) if full.count(full[:k]) == 1)
    (early,) = (await post(client, COMP, **GREEDY, max_tokens=10, stop=[stop]))["choices"]
    assert (early["text"], early["finish_reason"]) == ("", "stop")
    (late,) = (await post(client, COMP, **GREEDY, max_tokens=10, stop=[stop], min_tokens=8))[
        "choices"
    ]
    assert (late["text"], late["finish_reason"]) == (full, "length")


async def test_skip_special_tokens_false_keeps_their_text(client: httpx.AsyncClient) -> None:
    body = {**GREEDY, "max_tokens": 3, "allowed_token_ids": [1]}  # <bos>, no ending token
    assert (await post(client, COMP, **body))["choices"][0]["text"] == ""
    for spaces in (True, False):  # a fast tokenizer has no spacing option (as in vLLM)
        kept = await post(
            client, COMP, **body, skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        assert kept["choices"][0]["text"] == "<bos>" * 3
    streamed = await stream(client, COMP, **body, skip_special_tokens=False)
    assert "".join(c["choices"][0]["text"] for c in streamed) == "<bos>" * 3


@pytest.mark.parametrize("strategy", [{"temperature": 1.0, "seed": 3, "n": 2}, {"num_beams": 2}])
async def test_allowed_token_ids_are_the_only_ones_generated(
    client: httpx.AsyncClient, strategy: dict
) -> None:
    allowed = [40, 41, 42, 2]  # EOS (2) allowed too
    body = {"prompt": PROMPT, "max_tokens": 8, "allowed_token_ids": allowed, **strategy}
    for choice in (await post(client, COMP, **body, return_token_ids=True))["choices"]:
        assert choice["token_ids"] and set(choice["token_ids"]) <= set(allowed), choice
    without_eos = {**body, "allowed_token_ids": allowed[:-1], "n": 1, "num_beams": 1}
    (choice,) = (await post(client, COMP, **without_eos))["choices"]
    assert choice["finish_reason"] == "length"
    assert (await error(client, COMP, prompt="x", allowed_token_ids=[10**6]))["param"] == (
        "allowed_token_ids"
    )


async def test_return_token_ids_are_the_tokenizers(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    tok = tiny_ctx.tokenizer
    body = {**GREEDY, "max_tokens": 5, "return_token_ids": True}
    (choice,) = (await post(client, COMP, **body))["choices"]
    assert choice["prompt_token_ids"] == tok(PROMPT).input_ids
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    chunks = await stream(client, COMP, **body)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert "token_ids" not in (await post(client, COMP, **GREEDY, max_tokens=2))["choices"][0]
    chat_body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = await post(client, CHAT, **chat_body, return_token_ids=True)
    expected = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
    assert chat["prompt_token_ids"] == expected and len(chat["choices"][0]["token_ids"]) == 3
    chat_chunks = await stream(client, CHAT, **chat_body, return_token_ids=True)
    assert chat_chunks[0]["prompt_token_ids"] == expected
    streamed = [t for c in chat_chunks[1:] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]


async def test_truncate_prompt_tokens_keeps_the_prompts_last_k(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    ids = tiny_ctx.tokenizer(PROMPT).input_ids
    body = {**GREEDY, "max_tokens": 2, "return_token_ids": True, "truncate_prompt_tokens": 3}
    out = await post(client, COMP, **body)
    assert out["choices"][0]["prompt_token_ids"] == ids[-3:] and out["usage"]["prompt_tokens"] == 3
    right = await post(client, COMP, **body, truncation_side="right")
    assert right["choices"][0]["prompt_token_ids"] == ids[:3]
    whole = await post(client, COMP, **{**body, "truncate_prompt_tokens": 100})
    assert whole["choices"][0]["prompt_token_ids"] == ids
    long = {**body, "prompt": "x " * 600, "truncate_prompt_tokens": -1, "max_tokens": 7}
    assert (await post(client, COMP, **long))["usage"][
        "prompt_tokens"
    ] == tiny_ctx.max_model_len - 7
    chat = await post(client, CHAT, messages=MESSAGES, max_tokens=1, truncate_prompt_tokens=2)
    assert chat["usage"]["prompt_tokens"] == 2
    for k in (0, 10**6):
        assert (await error(client, COMP, **{**body, "truncate_prompt_tokens": k}))["param"] == (
            "truncate_prompt_tokens"
        )


async def test_add_special_tokens(client: httpx.AsyncClient, tiny_ctx: ServingContext) -> None:
    tok = tiny_ctx.tokenizer
    body = {**GREEDY, "max_tokens": 1, "return_token_ids": True, "add_special_tokens": False}
    no_bos = (await post(client, COMP, **body))["choices"][0]["prompt_token_ids"]
    assert no_bos == tok(PROMPT, add_special_tokens=False).input_ids
    chat = {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    plain = (await post(client, CHAT, **chat))["prompt_token_ids"]
    bos = (await post(client, CHAT, **chat, add_special_tokens=True))["prompt_token_ids"]
    assert plain[0] == tok.bos_token_id and bos == plain  # the template put it there already


async def test_chat_template_kwargs_documents_and_reasoning_effort_reach_the_template(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    tok = tiny_ctx.tokenizer
    tok.chat_template = (
        "{% if enable_thinking %}think {% endif %}{% if reasoning_effort %}effort "
        "{{ reasoning_effort }} {% endif %}{% for d in documents or [] %}doc {{ d.text }} "
        "{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    base = {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}

    async def prompt(**extra: Any) -> str:
        return tok.decode((await post(client, CHAT, **base, **extra))["prompt_token_ids"])

    assert await prompt() == "Hello there"
    assert await prompt(chat_template_kwargs={"enable_thinking": True}) == "think Hello there"
    assert await prompt(reasoning_effort="low") == "think effort low Hello there"
    assert await prompt(reasoning_effort="none") == "effort none Hello there"
    kwargs = {"enable_thinking": False}
    assert await prompt(reasoning_effort="low", chat_template_kwargs=kwargs) == (
        "effort low Hello there"
    )
    docs = [{"title": "t", "text": "fox"}]
    assert await prompt(documents=docs) == "doc fox Hello there"
    err = await error(client, CHAT, **base, chat_template_kwargs={"chat_template": "{{ 1 }}"})
    assert err["param"] == "chat_template_kwargs.chat_template"


async def test_chat_echo_starts_the_reply_with_the_message_it_continues(
    client: httpx.AsyncClient,
) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "continue_final_message": True}
    plain = (await post(client, CHAT, **body))["choices"][0]["message"]["content"]
    echoed = (await post(client, CHAT, **body, echo=True))["choices"][0]["message"]["content"]
    assert echoed == "Once upon" + plain
    chunks = await stream(client, CHAT, **body, echo=True)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == echoed
    reply = await post(client, CHAT, messages=MESSAGES, max_tokens=2, temperature=0, echo=True)
    assert not reply["choices"][0]["message"]["content"].startswith("Hello there")


async def test_request_id_names_the_response(client: httpx.AsyncClient) -> None:
    same = [
        client.post(COMP, json={**GREEDY, "max_tokens": 3, "request_id": "job-7"}) for _ in range(2)
    ]
    for r in await asyncio.gather(*same):  # the engine's ids stay unique
        assert r.status_code == 200 and r.json()["id"] == "cmpl-job-7"
    chat = await post(client, CHAT, messages=MESSAGES, max_tokens=1, request_id="c.1")
    assert chat["id"] == "chatcmpl-c.1"
    assert (await error(client, COMP, prompt="x", request_id="a b"))["param"] == "request_id"


async def test_guided_fields_are_structured_outputs(client: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    for choice in (await post(client, COMP, **body, guided_choice=["yes", "no"], n=2))["choices"]:
        assert choice["text"] in ("yes", "no")
    text = (await post(client, COMP, **body, guided_regex="[ab]{3}"))["choices"][0]["text"]
    assert len(text) == 3 and set(text) <= {"a", "b"}
    chat = await post(client, CHAT, messages=MESSAGES, max_tokens=8, guided_choice=["A", "B"])
    assert chat["choices"][0]["message"]["content"] in ("A", "B")


async def test_use_beam_search_is_beam_search_of_width_n(client: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5}
    beams = (await post(client, COMP, **body, use_beam_search=True, n=2))["choices"]
    reference = (await post(client, COMP, **body, num_beams=2, n=2))["choices"]
    assert [c["text"] for c in beams] == [c["text"] for c in reference]
    # the second request's prompt comes from the prefix cache: float32 sums in another order
    scores = [c["beam_score"] for c in reference]
    assert [c["beam_score"] for c in beams] == pytest.approx(scores, rel=1e-5)
    one = await post(client, COMP, **body, use_beam_search=True)
    greedy = await post(client, COMP, **body, temperature=0)
    assert one["choices"][0]["text"] == greedy["choices"][0]["text"]


async def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(
    client: httpx.AsyncClient,
) -> None:
    prompt = PROMPT + " and runs away from the early bird"

    async def cached(**extra: Any) -> int:
        out = await post(client, COMP, prompt=prompt, max_tokens=1, **extra)
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(cache_salt="a") == 0
    assert await cached(cache_salt="b") == 0
    assert await cached() == 0
    assert await cached(cache_salt="a") > 0
    assert await cached() > 0


async def test_accepted_fields_change_nothing(client: httpx.AsyncClient) -> None:
    body = {**GREEDY, "max_tokens": 4}
    plain = (await post(client, COMP, **body))["choices"]
    noop = {
        "guided_decoding_backend": "xgrammar",
        "session_id": "s",
        "stream_interval": 3,
        "routed_experts_prompt_start": 1,
        "return_token_offsets": True,
        "return_mm_kwargs": False,
        "priority": 5,
    }
    assert (await post(client, COMP, **body, **noop))["choices"] == plain
    chat = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    extra = {"mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {}, "include_reasoning": True}
    assert (await post(client, CHAT, **chat, **extra))["choices"] == (
        await post(client, CHAT, **chat)
    )["choices"]
    assert (await error(client, CHAT, **chat, include_reasoning=False))["param"] == (
        "include_reasoning"
    )
