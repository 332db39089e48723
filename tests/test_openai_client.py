"""The official openai client, unchanged, against a real uvicorn on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from tests.live_server import live_server


@pytest.fixture
def oa(tiny_ctx: ServingContext) -> Iterator[openai.OpenAI]:
    with live_server(create_app(ctx=tiny_ctx)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_client_completions_chat_and_streams(oa: openai.OpenAI) -> None:
    assert [m.id for m in oa.models.list().data] == ["tiny"]

    c = oa.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5

    stream = oa.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.choices[0].text

    chat = oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    stream = oa.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == 4


def test_openai_client_sees_typed_errors(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-3)
    assert info.value.body["param"] == "temperature"
