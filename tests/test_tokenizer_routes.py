"""POST /tokenize, POST /detokenize and GET /tokenizer_info in vLLM's shapes, BOS handling of text
prompts, and lm-evaluation-harness' remote tokenizer against a live server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from server.api.app import create_app
from server.api.serving import ServingContext
from server.api.tokenization import adds_bos, encode_text
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server
from tests.tiny_models import build_tokenizer

MESSAGES = [{"role": "user", "content": "Hello there"}]


async def test_tokenize_a_prompt_as_completions_runs_it(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    text = "The quick brown fox"
    r = await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    ids = tiny_ctx.tokenizer(text).input_ids
    assert out["tokens"] == ids and out["count"] == len(ids)
    assert out["max_model_len"] == tiny_ctx.max_model_len
    assert out["token_strs"] == tiny_ctx.tokenizer.convert_ids_to_tokens(ids)
    usage = (await client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})).json()
    assert usage["usage"]["prompt_tokens"] == out["count"]
    plain = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert plain.json()["token_strs"] is None


async def test_tokenize_messages_as_chat_runs_them(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    chat = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    no_prompt = await client.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    )
    assert no_prompt.json()["count"] < r.json()["count"]


async def test_an_assistant_refusal_is_in_the_prompt_as_what_it_said(
    client: httpx.AsyncClient,
) -> None:
    said = "I can't help with that."
    as_content = [*MESSAGES, {"role": "assistant", "content": said}, MESSAGES[0]]
    as_refusal = [*MESSAGES, {"role": "assistant", "refusal": said}, MESSAGES[0]]
    tokens = []
    for messages in (as_content, as_refusal):
        r = await client.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        tokens.append(r.json()["tokens"])
    assert tokens[0] == tokens[1]


async def test_detokenize_round_trips(client: httpx.AsyncClient) -> None:
    ids = (await client.post("/tokenize", json={"prompt": "café au lait"})).json()["tokens"]
    r = await client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200
    assert r.json() == {"prompt": "café au lait"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [
        ("/detokenize", {"tokens": [10**7]}, 400, "tokens", "invalid_token"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "invalid_value"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model", "model_not_found"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model", "model_not_found"),
        ("/tokenize", {"prompt": "x", "temperature": 1}, 400, None, None),
        ("/tokenize", {}, 400, None, None),
        ("/tokenize", {"messages": []}, 400, None, None),
    ],
)
async def test_bad_tokenizer_requests_get_openai_shaped_errors(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param and error["code"] == code


async def test_tokenizer_info(client: httpx.AsyncClient, tiny_ctx: ServingContext) -> None:
    r = await client.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    tok = tiny_ctx.tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["eos_token_id"] == tok.eos_token_id
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == tiny_ctx.max_model_len
    assert info["add_bos_token"] is False  # the tiny tokenizer adds no special tokens


async def test_tokenizer_routes_need_the_api_key(llama_dir: Path) -> None:
    ctx = serving_context(make_engine(llama_dir), api_keys=["secret"])
    app = create_app(ctx=ctx)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as c:
            for method, path, body in (
                ("POST", "/tokenize", {"prompt": "x"}),
                ("POST", "/detokenize", {"tokens": [1]}),
                ("GET", "/tokenizer_info", None),
            ):
                r = await c.request(method, path, json=body)
                assert r.status_code == 401, path
                ok = await c.request(
                    method, path, json=body, headers={"Authorization": "Bearer secret"}
                )
                assert ok.status_code == 200, path
    finally:
        ctx.engine.shutdown()


def test_a_text_that_starts_with_bos_gets_no_second_one() -> None:
    tok = build_tokenizer()
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    assert adds_bos(tok)
    plain = encode_text(tok, "Hi there")
    assert plain[0] == bos and plain[1] != bos
    assert encode_text(tok, "<bos>Hi there") == plain
    assert tok("<bos>Hi there").input_ids[:2] == [bos, bos]  # what the tokenizer alone does
    assert not adds_bos(build_tokenizer())


def test_lm_eval_remote_tokenizer_works_against_a_live_server(tiny_ctx: ServingContext) -> None:
    """lm-evaluation-harness' `local-completions` picks the server's tokenizer when
    /tokenizer_info and /tokenize answer as vLLM's do (its auto-detection)."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support  # the test extra

    with live_server(create_app(ctx=tiny_ctx)) as base:
        assert check_remote_tokenizer_support(f"{base}/v1/completions")
        remote = RemoteTokenizer(f"{base}/v1/completions")
        text = "The quick brown fox"
        ids = remote.encode(text)
        assert ids == tiny_ctx.tokenizer(text, add_special_tokens=False).input_ids
        assert remote.decode(ids) == text
        assert remote.eos_token_id == tiny_ctx.tokenizer.eos_token_id
        assert remote.bos_token_id == tiny_ctx.tokenizer.bos_token_id
