"""Property-based fuzzing of the two generation routes: whatever the body, never a 5xx.

Bodies mix valid and invalid values (any JSON value) for every documented field. Every 4xx has
OpenAI's error shape; every 200 is a complete answer with one choice per prompt and `n`. Generation
stays short (max_tokens <= 4, widths <= 4 unless the fuzzer picks an invalid one) so each example
costs milliseconds. After each property the engine is idle, the KV pool full, and a fixed greedy
request still gives the text it gave before.

`BEAMLINE_FUZZ_EXAMPLES` sets the number of examples (default 150 per route); the examples are the
same on every run unless `BEAMLINE_FUZZ_RANDOM=1` asks for fresh ones (for exploring, not for CI).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.api.app import create_app
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server
from tests.reliability_helpers import (
    PROBE,
    check_error_shape,
    completion_text,
    sse_payloads,
    wait_until_idle_sync,
)

VOCAB = 384
EXAMPLES = int(os.environ.get("BEAMLINE_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the work tree
    derandomize=not os.environ.get(
        "BEAMLINE_FUZZ_RANDOM"
    ),  # the same examples every run: CI reproduces
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- strategies ----------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
token_id = st.integers(0, VOCAB - 1)
short_text = st.text(max_size=24)
stop_text = st.text(min_size=1, max_size=4)


def small_max_tokens(value: Any) -> bool:
    """Keep generation short: no hostile value that would still be *accepted* as a large max_tokens,
    and no null (chat's default max_tokens is the rest of the context)."""
    if value is None:
        return False
    if isinstance(value, (list, dict)):
        return True
    try:
        return float(value) <= 4
    except (TypeError, ValueError, OverflowError):
        return True


def sometimes(
    hostile: st.SearchStrategy[Any], valid: st.SearchStrategy[Any], one_in: int
) -> st.SearchStrategy[Any]:
    """`valid`, except one time in `one_in` any value `hostile` draws."""
    return st.integers(1, one_in).flatmap(
        lambda k: hostile if k == one_in else valid
    )  # 1 is minimal


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly valid, sometimes any JSON value. A body carries ~10 optional fields, so even 1 in 12
    per field leaves about half of the bodies with at least one invalid value."""
    return sometimes(json_values, valid, one_in=12)


MAX_TOKENS = sometimes(json_values.filter(small_max_tokens), st.integers(1, 4), one_in=8)
# Fields that constrain each other come as a coherent strategy; `overrides` then breaks some bodies.
STRATEGIES = st.one_of(
    st.fixed_dictionaries({"temperature": st.just(0)}),
    st.fixed_dictionaries({"temperature": st.floats(0.1, 2), "n": st.integers(1, 3)}),
    st.fixed_dictionaries(
        {"best_of": st.just(3), "n": st.integers(1, 3), "seed": st.integers(0, 2**63 - 1)}
    ),
    st.fixed_dictionaries(
        {"num_beams": st.integers(2, 4), "n": st.integers(1, 2)},
        optional={
            "length_penalty": st.floats(-2, 2),
            "early_stopping": st.sampled_from([True, False, "never"]),
        },
    ),
    st.fixed_dictionaries(
        {
            "num_beams": st.just(4),
            "num_beam_groups": st.just(2),
            "diversity_penalty": st.floats(0, 2),
        }
    ),
    st.fixed_dictionaries(
        {"num_beams": st.just(2), "do_sample": st.just(True), "temperature": st.floats(0.5, 1.5)}
    ),
)
STRATEGY_FIELDS = [
    "temperature",
    "n",
    "best_of",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "length_penalty",
    "early_stopping",
    "do_sample",
]
OVERRIDES = st.one_of(
    st.just({}),
    st.just({}),
    st.just({}),
    st.dictionaries(st.sampled_from(STRATEGY_FIELDS), json_values, min_size=1, max_size=2),
)
SHARED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": field(st.just("tiny")),
    "top_p": field(st.floats(0.01, 1)),
    "top_k": field(st.integers(0, 50)),
    "min_p": field(st.floats(0, 1)),
    "typical_p": field(st.floats(0.01, 1)),
    "repetition_penalty": field(st.floats(0.5, 2)),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "no_repeat_ngram_size": field(st.integers(0, 3)),
    "min_tokens": field(st.integers(0, 1)),
    "logit_bias": field(st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3)),
    "bad_words_ids": field(st.lists(st.lists(token_id, min_size=1, max_size=3), max_size=2)),
    "bad_words": field(st.lists(stop_text, max_size=2)),
    "seed": field(st.integers(0, 2**63 - 1)),
    "stop": field(st.one_of(stop_text, st.lists(stop_text, max_size=3))),
    "stop_token_ids": field(st.lists(token_id, max_size=3)),
    "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": field(short_text),
}


def with_strategy(base: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(base, STRATEGIES, OVERRIDES).map(lambda t: {**t[0], **t[1], **t[2]})


prompts = st.one_of(  # never empty: empty prompts are the hostile table's job
    st.text(min_size=1, max_size=24),
    st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=3),
    st.lists(token_id, min_size=1, max_size=8),
    st.lists(st.lists(token_id, min_size=1, max_size=5), min_size=1, max_size=3),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
            "content": st.one_of(
                short_text,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": short_text}), max_size=2
                ),
            ),
        },
    ),
    min_size=1,
    max_size=4,
)
completion_bodies = with_strategy(
    st.fixed_dictionaries(
        {"prompt": field(prompts), "max_tokens": MAX_TOKENS},
        optional={
            **SHARED_FIELDS,
            "logprobs": field(st.integers(0, 5)),
            "echo": field(st.booleans()),
        },
    )
)
chat_bodies = with_strategy(
    st.fixed_dictionaries(
        # chat's max_tokens defaults to the rest of the context: always bound it
        {"messages": field(messages), "max_tokens": MAX_TOKENS},
        optional={
            **SHARED_FIELDS,
            "logprobs": field(st.booleans()),
            "top_logprobs": field(st.integers(0, 5)),
        },
    )
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    completion_bodies.map(lambda b: json.dumps(b).encode()).flatmap(
        lambda data: st.integers(0, len(data)).map(lambda cut: data[:cut])  # truncated JSON
    ),
)
content_types = st.sampled_from(
    [
        "application/json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=b",
        "",
        "application/json; charset=utf-16",
    ]
)


# ---- checks --------------------------------------------------------------------------------------
def plain_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def expected_choices(body: dict[str, Any], chat: bool) -> int | None:
    """Choices a 200 must carry (prompts x n), or None when coercion makes it uncertain."""
    n = plain_int(body.get("n", 1))
    if n is None:
        return None
    if chat:
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(plain_int(t) is not None for t in prompt)
    ):
        return n
    if isinstance(prompt, list):
        return n * len(prompt)
    return None


def check_reply(body: dict[str, Any], r: httpx.Response, chat: bool) -> None:
    assert r.status_code < 500, f"{r.status_code} for {body!r}: {r.text[:500]}"
    if r.status_code >= 400:
        check_error_shape(r)
        return
    assert r.status_code == 200, (r.status_code, r.text[:300])
    want = expected_choices(body, chat)
    if r.headers["content-type"].startswith("text/event-stream"):
        payloads = sse_payloads(r.text)
        assert payloads[-1] == "[DONE]", payloads[-3:]
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert all("error" not in c for c in chunks), chunks
        finished = {ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")}
        if want is not None:
            assert finished == set(range(want)), (finished, want, body)
    else:
        reply = r.json()
        assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"]), reply
        if want is not None:
            assert [c["index"] for c in reply["choices"]] == list(range(want)), (reply, body)
        usage = reply["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage


# ---- fixtures and tests --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_client(tiny_model_dirs: dict[str, Path]) -> Iterator[httpx.Client]:
    ctx = serving_context(make_engine(tiny_model_dirs["llama"]))
    try:
        with (
            live_server(create_app(ctx=ctx)) as url,
            httpx.Client(base_url=url, timeout=60) as client,
        ):
            yield client
    finally:
        ctx.engine.shutdown()


@pytest.fixture(scope="module")
def probe_text(fuzz_client: httpx.Client) -> str:
    r = fuzz_client.post("/v1/completions", json=PROBE)
    assert r.status_code == 200, r.text
    return completion_text(r.json())


def assert_mixed(statuses: Counter[int]) -> None:
    """The fuzzer must exercise both sides: accepted bodies (the engine ran) and refused ones."""
    total = sum(statuses.values())
    accepted = statuses[200]
    refused = sum(v for k, v in statuses.items() if 400 <= k < 500)
    assert accepted >= total // 10 and refused >= total // 10, statuses


def assert_server_intact(client: httpx.Client, probe_text: str) -> None:
    wait_until_idle_sync(client, timeout=5)
    r = client.post("/v1/completions", json=PROBE)
    assert r.status_code == 200 and completion_text(r.json()) == probe_text, r.text
    wait_until_idle_sync(client, timeout=5)


@pytest.mark.timeout(300)
def test_fuzzed_completion_bodies_never_get_a_5xx(
    fuzz_client: httpx.Client, probe_text: str
) -> None:
    @FUZZ_SETTINGS
    @given(body=completion_bodies)
    def run(body: dict[str, Any]) -> None:
        r = fuzz_client.post(
            "/v1/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        statuses[r.status_code] += 1
        check_reply(body, r, chat=False)

    statuses: Counter[int] = Counter()
    run()
    assert_mixed(statuses)
    assert_server_intact(fuzz_client, probe_text)


@pytest.mark.timeout(300)
def test_fuzzed_chat_bodies_never_get_a_5xx(fuzz_client: httpx.Client, probe_text: str) -> None:
    @FUZZ_SETTINGS
    @given(body=chat_bodies)
    def run(body: dict[str, Any]) -> None:
        r = fuzz_client.post(
            "/v1/chat/completions",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )
        statuses[r.status_code] += 1
        check_reply(body, r, chat=True)

    statuses: Counter[int] = Counter()
    run()
    assert_mixed(statuses)
    assert_server_intact(fuzz_client, probe_text)


@pytest.mark.timeout(300)
def test_fuzzed_raw_bytes_get_a_4xx_in_the_error_shape(
    fuzz_client: httpx.Client, probe_text: str
) -> None:
    @settings(FUZZ_SETTINGS, max_examples=max(1, EXAMPLES // 2))
    @given(
        data=raw_bodies,
        content_type=content_types,
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    )
    def run(data: bytes, content_type: str, path: str) -> None:
        headers = {"content-type": content_type} if content_type else {}
        r = fuzz_client.post(path, content=data, headers=headers)
        assert r.status_code < 500, (r.status_code, data, r.text[:300])
        if r.status_code >= 400:
            check_error_shape(r)

    run()
    assert_server_intact(fuzz_client, probe_text)
