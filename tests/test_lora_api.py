"""LoRA adapters over HTTP: `model` picks an adapter, /v1/models lists them with their parent,
vLLM's runtime load / unload routes (off unless enabled, behind the API key) change them while
requests run with nothing lost, hostile adapters are a 400, and the Gateway API Inference
Extension's `vllm:lora_requests_info` and per-adapter counters are served. Once with the engine in
a thread, once through the real CLI with the engine in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from server.api.app import create_app
from server.api.serving import ServingContext
from tests.conftest import hf_reference, make_engine, serving_context
from tests.live_server import free_port
from tests.lora_adapters import make_adapter, merged_model
from tests.reliability_helpers import assert_openai_error, sse_payloads
from tests.test_lora import hf_greedy

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Hello world! How are you"


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api_adapters")
    return {
        "alpha": make_adapter(llama_dir, root / "alpha", r=8, seed=1, scale=30.0),
        "beta": make_adapter(
            llama_dir, root / "beta", r=16, targets=["gate_proj", "down_proj"], seed=2, scale=30.0
        ),
    }


@pytest.fixture
def lora_ctx(llama_dir: Path, adapters: dict[str, Path]) -> Iterator[ServingContext]:
    engine = make_engine(llama_dir, max_loras=2)
    engine.load_adapter("alpha", str(adapters["alpha"]))
    ctx = serving_context(
        engine, allow_runtime_lora_updating=True, api_keys=["sk-test"], lora_modules=[]
    )
    yield ctx
    ctx.engine.shutdown()


@pytest.fixture
async def api(lora_ctx: ServingContext) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(ctx=lora_ctx))
    headers = {"Authorization": "Bearer sk-test"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
        yield c


def expected_tokens(llama_dir: Path, adapter: Path | None, ids: list[int], n: int) -> list[int]:
    model = merged_model(llama_dir, adapter) if adapter else hf_reference(llama_dir)[0]
    return hf_greedy(model, ids, n)


BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


async def test_model_picks_the_adapter_and_responses_name_it(
    api: httpx.AsyncClient, llama_dir: Path, adapters: dict[str, Path], lora_ctx: ServingContext
) -> None:
    ids = lora_ctx.tokenizer(PROMPT).input_ids
    body = {**BODY, "return_token_ids": True}
    with_adapter = await api.post("/v1/completions", json={**body, "model": "alpha"})
    base = await api.post("/v1/completions", json={**body, "model": "tiny"})
    assert with_adapter.status_code == 200 and base.status_code == 200
    assert with_adapter.json()["model"] == "alpha" and base.json()["model"] == "tiny"
    got = with_adapter.json()["choices"][0]["token_ids"]
    assert got == expected_tokens(llama_dir, adapters["alpha"], ids, 8)
    assert base.json()["choices"][0]["token_ids"] == expected_tokens(llama_dir, None, ids, 8)
    # streamed, the chunks name the adapter too
    stream = await api.post("/v1/completions", json={**body, "model": "alpha", "stream": True})
    chunks = [json.loads(p) for p in sse_payloads(stream.text) if p != "[DONE]"]
    assert {c["model"] for c in chunks} == {"alpha"}
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert streamed == got


async def test_models_list_the_adapters_with_their_parent(
    api: httpx.AsyncClient, adapters: dict[str, Path]
) -> None:
    data = (await api.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == ["tiny", "alpha"]
    assert data[0]["parent"] is None
    assert data[1]["parent"] == "tiny" and data[1]["root"] == str(adapters["alpha"])


async def test_an_unknown_model_is_a_404_naming_what_is_served(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/completions", json={**BODY, "model": "gamma"})
    assert_openai_error(r, 404, code="model_not_found", param="model")
    assert "'alpha'" in r.json()["error"]["message"]


async def test_chat_structured_outputs_and_tools_work_with_an_adapter(
    api: httpx.AsyncClient,
) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = await api.post(
        "/v1/chat/completions",
        json={
            "model": "alpha",
            "messages": [{"role": "user", "content": "a number"}],
            "max_tokens": 30,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "alpha"
    content = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content)["n"], int)
    tool = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
    }
    r = await api.post(
        "/v1/chat/completions",
        json={
            "model": "alpha",
            "messages": [{"role": "user", "content": "call it"}],
            "max_tokens": 40,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "add"}},
        },
    )
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "add"
    beams = await api.post(
        "/v1/completions",
        json={**BODY, "model": "alpha", "num_beams": 3, "n": 2, "ignore_eos": False},
    )
    assert beams.status_code == 200 and len(beams.json()["choices"]) == 2


async def test_runtime_load_and_unload_under_load_lose_nothing(
    api: httpx.AsyncClient, llama_dir: Path, adapters: dict[str, Path], lora_ctx: ServingContext
) -> None:
    ids = lora_ctx.tokenizer(PROMPT).input_ids
    long = {**BODY, "max_tokens": 40, "return_token_ids": True}

    async def complete(model: str) -> list[int]:
        r = await api.post("/v1/completions", json={**long, "model": model})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    running = [asyncio.create_task(complete(m)) for m in ("alpha", "tiny", "alpha")]
    await asyncio.sleep(0.05)
    loaded = await api.post(
        "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(adapters["beta"])}
    )
    assert loaded.status_code == 200 and "beta" in loaded.text
    beta = await complete("beta")
    unloaded = await api.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
    assert unloaded.status_code == 200
    results = await asyncio.gather(*running)
    want_alpha = expected_tokens(llama_dir, adapters["alpha"], ids, 40)
    assert results == [want_alpha, expected_tokens(llama_dir, None, ids, 40), want_alpha]
    assert beta == expected_tokens(llama_dir, adapters["beta"], ids, 40)
    gone = await api.post("/v1/completions", json={**BODY, "model": "alpha"})
    assert_openai_error(gone, 404, code="model_not_found", param="model")
    again = await api.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
    assert_openai_error(again, 404, code="model_not_found", param="lora_name")
    twice = await api.post(
        "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(adapters["beta"])}
    )
    assert_openai_error(twice, 400, code="adapter_exists", param="lora_name")
    models = (await api.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["tiny", "beta"]
    stats = lora_ctx.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "invalid_adapter"),
        ({"lora_name": "x", "lora_path": "org/not-cached-adapter"}, 400, "invalid_adapter"),
        ({"lora_name": "tiny", "lora_path": "/x"}, 400, "invalid_value"),
        ({"lora_name": "x"}, 400, None),
        ({"lora_name": "x", "lora_path": "/x", "load_inplace": True}, 400, None),
    ],
)
async def test_bad_loads_are_400s_and_the_server_keeps_serving(
    api: httpx.AsyncClient,
    body: dict,
    status: int,
    code: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = await api.post("/v1/load_lora_adapter", json=body)
    assert_openai_error(r, status, code=code)
    ok = await api.post("/v1/completions", json={**BODY, "model": "alpha"})
    assert ok.status_code == 200


async def test_an_adapter_of_another_shape_is_a_400(
    api: httpx.AsyncClient, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter trained on another base (its A matrices 32 wide where this model's are 64)."""
    bad = tmp_path / "other_base"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes(
        (adapters["alpha"] / "adapter_config.json").read_bytes()
    )
    weights = load_file(adapters["alpha"] / "adapter_model.safetensors")
    save_file(
        {k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in weights.items()},
        bad / "adapter_model.safetensors",
    )
    r = await api.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(bad)})
    assert_openai_error(r, 400, code="invalid_adapter", param="lora_path")
    assert "was not trained on this model" in r.json()["error"]["message"]


async def test_runtime_routes_need_the_api_key(lora_ctx: ServingContext) -> None:
    transport = httpx.ASGITransport(app=create_app(ctx=lora_ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as anonymous:
        r = await anonymous.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
    assert r.status_code == 401
    assert "alpha" in lora_ctx.engine.adapter_names()


async def test_runtime_routes_are_off_unless_enabled(llama_dir: Path) -> None:
    ctx = serving_context(make_engine(llama_dir, max_loras=1))
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert r.status_code == 404
    finally:
        ctx.engine.shutdown()


async def test_lora_metrics_name_the_adapters_and_count_their_requests(
    api: httpx.AsyncClient,
) -> None:
    for _ in range(2):
        assert (await api.post("/v1/completions", json={**BODY, "model": "alpha"})).is_success
    assert (await api.post("/v1/completions", json=BODY)).is_success
    text = (await api.get("/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    (info,) = fams["vllm:lora_requests_info"].samples
    assert info.labels["max_lora"] == "2"
    assert {info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]} <= {
        "",
        "alpha",
    }
    assert 0 < time.time() - info.value < 60
    counts = {
        s.labels["lora_name"]: s.value
        for s in fams["beamline:lora_requests"].samples
        if s.name.endswith("_total")
    }
    assert counts == {"alpha": 2.0}


def test_the_cli_serves_adapters_with_the_engine_in_its_own_process(
    llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """`beamline serve --lora-modules a=dir --enable-lora --allow-runtime-lora-updating`, the
    engine in a process of its own: adapters listed, served, loaded and unloaded at runtime."""
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(llama_dir),
        "--host", "127.0.0.1", "--port", str(port), "--engine-process", "on",
        "--num-kv-blocks", "256", "--max-loras", "2", "--allow-runtime-lora-updating",
        "--lora-modules", f"alpha={adapters['alpha']}", "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "engine process" in log.read_text()
        name = llama_dir.name
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [(name, None), ("alpha", name)]
        body = {**BODY, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "alpha"}, timeout=60)
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]["token_ids"]
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "beta", "lora_path": str(adapters["beta"])},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        bad = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": str(tmp_path)},
            timeout=60,
        )
        assert_openai_error(bad, 400, code="invalid_adapter")
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "beta"}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "beta"
        assert r.json()["choices"][0]["token_ids"] != first
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "alpha"}).is_success
        gone = httpx.post(f"{url}/v1/completions", json={**body, "model": "alpha"}, timeout=60)
        assert_openai_error(gone, 404, code="model_not_found")
        metrics = httpx.get(f"{url}/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(metrics)}
        counts = {
            s.labels["lora_name"]: s.value
            for s in fams["beamline:lora_requests"].samples
            if s.name.endswith("_total")
        }
        assert counts == {"alpha": 1.0, "beta": 1.0}  # the 404 after the unload not counted
        (info,) = fams["vllm:lora_requests_info"].samples
        assert info.labels["max_lora"] == "2"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
