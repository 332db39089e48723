"""LM fusion over HTTP: `--extra-models` loaded at start-up (the KV budget shared, what cannot be
fused refused), `lm_fusion` on completions, chat and the Responses API (through the openai
client's `extra_body` too), and each kind of bad input a 400 naming its field while the server
keeps serving."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from decoding.fusion import LMFusion
from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig
from server.model.kv_budget import GiB, KVBudget, plan_num_blocks
from server.runner_setup import extra_kv_bytes, extra_weight_bytes
from tests.live_server import live_server
from tests.reliability_helpers import assert_openai_error
from tests.test_lm_fusion import FusedScores
from tests.tiny_models import build_tiny_model
from tests.tiny_seq2seq import build_tiny_seq2seq

PROMPT = [1, 45, 97, 20]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fusion_api")
    main = build_tiny_model(root / "main", "llama", seed=0)
    lm = build_tiny_model(root / "lm", "llama", seed=1)
    other = root / "other"  # the same model, a tokenizer with one more token
    shutil.copytree(lm, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<zz>"])
    tokenizer.save_pretrained(other)
    return {"main": main, "lm": lm, "other": other, "root": root}


def settings(dirs: dict[str, Path], **more: object) -> ServerConfig:
    base: dict = dict(
        model=str(dirs["main"]),
        served_model_name="tiny",
        device="cpu",
        num_kv_blocks=128,
        block_size=4,
        engine_process="off",
        extra_models=[f"lm={dirs['lm']}", f"other={dirs['other']}"],
    )
    return ServerConfig(**(base | more))


@pytest.fixture(scope="module")
def ctx(dirs: dict[str, Path]) -> Iterator[ServingContext]:
    ctx = build_serving_context(settings(dirs))
    yield ctx
    ctx.engine.shutdown()


@pytest.fixture
async def client(ctx: ServingContext) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(ctx=ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def fused_reference(dirs: dict[str, Path], weight: float, max_new_tokens: int) -> list[int]:
    main, lm = (
        AutoModelForCausalLM.from_pretrained(dirs[k], dtype=torch.float32).eval()
        for k in ("main", "lm")
    )
    ids = torch.tensor([PROMPT])
    out = main.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([FusedScores(lm, weight)]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return out[0, len(PROMPT) :].tolist()


async def test_completions_fuse_the_extra_model(
    client: httpx.AsyncClient, dirs: dict[str, Path]
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    fused = await client.post(
        "/v1/completions", json=body | {"lm_fusion": {"model": "lm", "weight": 0.9}}
    )
    plain = await client.post("/v1/completions", json=body)
    assert fused.status_code == 200, fused.text
    tokens = fused.json()["choices"][0]["token_ids"]
    assert tokens == fused_reference(dirs, 0.9, 8)
    assert tokens != plain.json()["choices"][0]["token_ids"]


async def test_chat_and_beams_take_lm_fusion(client: httpx.AsyncClient) -> None:
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 5,
            "num_beams": 3,
            "n": 2,
            "lm_fusion": {"model": "lm", "weight": -1.0, "plausibility": 0.1},
        },
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2


def test_the_openai_client_sends_lm_fusion_in_extra_body(dirs: dict[str, Path]) -> None:
    fusion = {"lm_fusion": {"model": "lm", "weight": 0.5}}
    ctx = build_serving_context(settings(dirs))  # its own: the server's end stops its engine
    with live_server(create_app(ctx=ctx)) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        done = oa.completions.create(
            model="tiny", prompt="Hello", max_tokens=4, temperature=0, extra_body=fusion
        )
        assert done.choices[0].text
        reply = oa.responses.create(
            model="tiny", input="Hello", max_output_tokens=4, temperature=0, extra_body=fusion
        )
        assert reply.output_text
        with pytest.raises(openai.BadRequestError, match="is not an extra model"):
            oa.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Hi"}],
                extra_body={"lm_fusion": {"model": "tiny", "weight": 1.0}},
            )


@pytest.mark.parametrize(
    ("fusion", "param", "code"),
    [
        ({"model": "nope", "weight": 1.0}, "lm_fusion.model", "model_not_found"),
        ({"model": "other", "weight": 1.0}, "lm_fusion.model", "vocabulary_mismatch"),
        ({"model": "lm", "weight": "NaN"}, "lm_fusion.weight", None),
        ({"model": "lm", "weight": 1.0, "plausibility": 1.0}, "lm_fusion.plausibility", None),
        ({"model": "lm"}, "lm_fusion.weight", None),
        ({"model": "lm", "weight": 1.0, "lm_weight": 2}, "lm_fusion.lm_weight", None),
    ],
)
async def test_bad_lm_fusion_is_a_400_and_the_server_keeps_serving(
    client: httpx.AsyncClient, fusion: dict, param: str, code: str | None
) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "lm_fusion": fusion}
    if fusion.get("weight") == "NaN":  # what Python's JSON reader takes as a float
        content = httpx.Request("POST", "/", json=body).content.replace(b'"NaN"', b"NaN")
        got = await client.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
    else:
        got = await client.post("/v1/completions", json=body)
    assert_openai_error(got, 400, param, code)
    ok = await client.post("/v1/completions", json=body | {"lm_fusion": None})
    assert ok.status_code == 200


async def test_prompt_logprobs_with_lm_fusion_is_a_400(client: httpx.AsyncClient) -> None:
    got = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Hello",
            "prompt_logprobs": 1,
            "lm_fusion": {"model": "lm", "weight": 1.0},
        },
    )
    assert_openai_error(got, 400, "prompt_logprobs")


def test_extra_models_share_the_kv_budget(dirs: dict[str, Path]) -> None:
    """A memory budget sizes the main pool by every model's bytes per block, and each extra
    model's pool has the main pool's block count."""
    one = extra_kv_bytes(settings(dirs, extra_models=[f"lm={dirs['lm']}"]), torch.float32)
    assert one > 0
    budget = 64 * 2 * one  # 64 blocks of the two models (the same shape)
    ctx = build_serving_context(settings(dirs, num_kv_blocks=None, kv_cache_memory=budget,
                                         extra_models=[f"lm={dirs['lm']}"]))  # fmt: skip
    try:
        assert ctx.engine.kv_capacity.num_blocks == 64
        assert ctx.fusion_models == {"lm": None}
    finally:
        ctx.engine.shutdown()


def test_an_automatic_gpu_pool_leaves_room_for_the_extra_models_weights(
    dirs: dict[str, Path],
) -> None:
    """The pool is sized before the extra models load: their weights, in the served dtype, count
    as memory in use (a fake GPU: the arithmetic is device-free)."""
    lm = AutoModelForCausalLM.from_pretrained(dirs["lm"])
    params = sum(p.numel() for p in lm.parameters())
    config = settings(dirs, extra_models=[f"lm={dirs['lm']}", f"other={dirs['other']}"])
    assert extra_weight_bytes(config, torch.float16) == 2 * 2 * params
    assert extra_weight_bytes(settings(dirs, extra_models=[]), torch.float16) == 0
    gpu = torch.device("cuda")  # a label: nothing runs on it
    plan = dict(num_blocks=None, bytes_per_block=2**20, block_size=16, device=gpu)
    plan |= dict(max_model_len=1024, profile=lambda: 0, mem_info=lambda d: (70 * GiB, 80 * GiB))
    alone = plan_num_blocks(KVBudget(), **plan)  # type: ignore[arg-type]
    beside = plan_num_blocks(KVBudget(reserved_bytes=4 * GiB), **plan)  # type: ignore[arg-type]
    assert alone - beside == 4 * 1024


def test_an_encoder_decoder_extra_model_is_refused_at_start_up(dirs: dict[str, Path]) -> None:
    marian = build_tiny_seq2seq(dirs["root"] / "marian", "marian")
    with pytest.raises(ModelLoadFailed, match="encoder-decoder model: LM fusion needs"):
        build_serving_context(settings(dirs, extra_models=[f"mt={marian}"]))


def test_extra_model_entries_are_name_equals_source() -> None:
    with pytest.raises(ValueError, match="NAME=SOURCE"):
        ServerConfig(extra_models=["lm"])
    with pytest.raises(ValueError, match="each model once"):
        ServerConfig(extra_models=["lm=a", "lm=b"])
    assert ServerConfig(extra_models="a=x, b=y").extra_model_sources() == {"a": "x", "b": "y"}


def test_lm_fusion_checks_its_values() -> None:
    for bad in (dict(weight=float("inf")), dict(weight=1.0, plausibility=-0.1)):
        with pytest.raises(ValueError):
            LMFusion("lm", **bad)  # type: ignore[arg-type]


async def test_an_engine_process_loads_the_extra_models_too(dirs: dict[str, Path]) -> None:
    ctx = build_serving_context(settings(dirs, engine_process="on"))
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            body |= {"ignore_eos": True, "return_token_ids": True}
            body["lm_fusion"] = {"model": "lm", "weight": 0.9}
            got = await client.post("/v1/completions", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == fused_reference(dirs, 0.9, 8)
    finally:
        ctx.engine.shutdown()


@pytest.mark.parametrize("num_beams", [1, 3])
async def test_structured_outputs_constrain_the_fused_scores(
    client: httpx.AsyncClient, num_beams: int
) -> None:
    choices = ["quick brown fox", "lazy dog", "hello world"]
    got = await client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The",
            "max_tokens": 16,
            "num_beams": num_beams,
            "structured_outputs": {"choice": choices},
            "lm_fusion": {"model": "lm", "weight": 1.5},
        },
    )
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] in choices


async def test_a_translation_server_fuses_its_target_lm(dirs: dict[str, Path]) -> None:
    """Over HTTP too: a Marian served with a target-side LM (its tokenizer beside it) fuses it
    into beam search; an LM whose tokenizer cannot be read is named unusable, not fatal."""
    root = dirs["root"]
    marian = build_tiny_seq2seq(root / "mt", "marian")
    lm_dir = build_tiny_model(root / "mt-lm", "llama", seed=3)  # then given Marian's vocabulary
    lm = AutoModelForCausalLM.from_pretrained(lm_dir)
    lm.resize_token_embeddings(AutoTokenizer.from_pretrained(marian).vocab_size)
    lm.save_pretrained(lm_dir)
    AutoTokenizer.from_pretrained(marian).save_pretrained(lm_dir)
    bare = root / "mt-lm-bare"  # the same weights, no tokenizer files
    lm.save_pretrained(bare)
    config = settings(dirs, model=str(marian), extra_models=[f"lm={lm_dir}", f"bare={bare}"])
    ctx = build_serving_context(config)
    try:
        assert ctx.fusion_models["lm"] is None and "could not be read" in str(
            ctx.fusion_models["bare"]
        )
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": "tiny", "prompt": "Hello world!", "max_tokens": 6, "num_beams": 3}
            plain = await client.post("/v1/completions", json=body)
            fused = await client.post(
                "/v1/completions", json=body | {"lm_fusion": {"model": "lm", "weight": 2.0}}
            )
            bad = await client.post(
                "/v1/completions", json=body | {"lm_fusion": {"model": "bare", "weight": 1.0}}
            )
        assert plain.status_code == fused.status_code == 200, fused.text
        assert fused.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]
        assert_openai_error(bad, 400, "lm_fusion.model", "vocabulary_mismatch")
    finally:
        ctx.engine.shutdown()
