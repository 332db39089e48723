"""Several models from one server over HTTP: a request's `model` names an extra model, which
answers it (token-exact against its own `generate()`), with its own sampling defaults, under its
name in the response, in /v1/models and in the metrics' `model_name`; an extra model that cannot
serve requests (another tokenizer, other end-of-sequence ids) is a 400 saying why, an unknown
name a 404 listing what is served, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import build_serving_context
from server.config import ServerConfig
from tests.live_server import live_server
from tests.reliability_helpers import assert_openai_error
from tests.tiny_models import build_tiny_model

PROMPT = [1, 45, 97, 20]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("named_api")
    main = build_tiny_model(root / "main", "llama", seed=0)
    second = build_tiny_model(root / "second", "llama", seed=1)
    config = json.loads((second / "generation_config.json").read_text())
    (second / "generation_config.json").write_text(json.dumps(config | {"top_k": 7}))
    other = root / "other"  # the same weights, a tokenizer with one more token
    shutil.copytree(second, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<zz>"])
    tokenizer.save_pretrained(other)
    ending = root / "ending"  # the same weights, another id ends its sequences
    shutil.copytree(second, ending)
    (ending / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": 9}))
    return {"main": main, "second": second, "other": other, "ending": ending}


def settings(dirs: dict[str, Path], **more: object) -> ServerConfig:
    base: dict = dict(
        model=str(dirs["main"]),
        served_model_name="tiny",
        device="cpu",
        num_kv_blocks=128,
        block_size=4,
        engine_process="off",
        extra_models=[f"{name}={dirs[name]}" for name in ("second", "other", "ending")],
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


def greedy(model_dir: Path, max_new_tokens: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
    )
    return out[0, len(PROMPT) :].tolist()


def body(model: str, **more: object) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | more


async def test_a_request_naming_an_extra_model_is_answered_by_it(
    client: httpx.AsyncClient, dirs: dict[str, Path]
) -> None:
    extra = {"ignore_eos": True, "return_token_ids": True}
    second = await client.post("/v1/completions", json=body("second", **extra))
    main = await client.post("/v1/completions", json=body("tiny", **extra))
    assert second.status_code == 200, second.text
    assert second.json()["model"] == "second" and main.json()["model"] == "tiny"
    assert second.json()["choices"][0]["token_ids"] == greedy(dirs["second"], 6)
    assert main.json()["choices"][0]["token_ids"] == greedy(dirs["main"], 6)
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": "second",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "num_beams": 2,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "second"


async def test_models_lists_the_extra_models_requests_can_name(client: httpx.AsyncClient) -> None:
    cards = {card["id"]: card for card in (await client.get("/v1/models")).json()["data"]}
    assert list(cards) == ["tiny", "second"]  # `other` and `ending` fuse or draft at most
    assert cards["second"]["sampling_defaults"] == {"top_k": 7}
    assert cards["tiny"]["sampling_defaults"] == {}
    assert cards["second"]["root"].endswith("second") and cards["second"]["parent"] is None


@pytest.mark.parametrize(
    ("model", "status", "code", "says"),
    [
        ("other", 400, "model_not_supported", "other ids to the same tokens"),
        ("ending", 400, "model_not_supported", "end at token ids [2, 9]"),
        ("nope", 404, "model_not_found", "'tiny', 'second'"),
    ],
)
async def test_a_model_that_cannot_answer_is_a_4xx_and_the_server_keeps_serving(
    client: httpx.AsyncClient, model: str, status: int, code: str, says: str
) -> None:
    got = await client.post("/v1/completions", json=body(model))
    assert_openai_error(got, status, "model", code)
    assert says in got.json()["error"]["message"]
    assert (await client.post("/v1/completions", json=body("second"))).status_code == 200


async def test_a_model_is_not_fused_with_itself(client: httpx.AsyncClient) -> None:
    fused = body("second", lm_fusion={"model": "second", "weight": 1.0})
    assert_openai_error(await client.post("/v1/completions", json=fused), 400, "lm_fusion.model")
    other = body("second", lm_fusion={"model": "tiny", "weight": 1.0})  # not an extra model
    assert_openai_error(await client.post("/v1/completions", json=other), 400, "lm_fusion.model")


def metric(ctx: ServingContext, name: str, **labels: str) -> float:
    assert ctx.metrics is not None
    for family in text_string_to_metric_families(ctx.metrics.render()[0].decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


async def test_metrics_count_each_request_under_the_model_that_ran_it(
    client: httpx.AsyncClient, ctx: ServingContext
) -> None:
    name = "beamline:generation_tokens_total"
    before = metric(ctx, name, model_name="second"), metric(ctx, name, model_name="tiny")
    got = await client.post("/v1/completions", json=body("second", max_tokens=5, ignore_eos=True))
    assert got.status_code == 200
    after = metric(ctx, name, model_name="second"), metric(ctx, name, model_name="tiny")
    assert (after[0] - before[0], after[1] - before[1]) == (5, 0)
    success = "beamline:request_success_total"
    assert metric(ctx, success, model_name="second", finished_reason="length") >= 1


def test_an_engine_process_runs_an_extra_models_requests(dirs: dict[str, Path]) -> None:
    """The model name travels to an engine of its own process; the openai client names it."""
    ctx = build_serving_context(settings(dirs, engine_process="on"))
    with live_server(create_app(ctx=ctx)) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        done = oa.completions.create(
            model="second",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert done.model == "second"
        assert done.choices[0].model_extra["token_ids"] == greedy(dirs["second"], 6)
        assert [m.id for m in oa.models.list()] == ["tiny", "second"]
