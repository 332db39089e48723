"""Tensor parallelism on the CPU (gloo): a model split over 2 (and 4) ranks answers what the same
model on one rank answers (2 ranks with their decode steps compiled), for every strategy, mixed
batches, prompt scoring, speculation, preemption and LoRA adapters (tokens exact; logprobs within
LOGPROB_TOLERANCE: the sums over the ranks add in another order); the default model split in 2
gives Hugging Face's greedy tokens; a dead rank ends the engine with no hang; impossible sizes are
refused before loading."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from decoding import DecodingParams
from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig
from server.model.kv_pool import KVLayout
from server.model.loader import resolve_model_dir
from server.model.weights import text_config
from server.parallel import group
from server.parallel.shard import TPConfigError, check_tp_size
from server.process.client import EngineProcessClient
from tests.lora_adapters import make_adapter
from tests.reliability_helpers import (
    assert_engine_dead,
    follower_pids,
    post_to,
    process_gone,
    sse_payloads,
)

pytestmark = pytest.mark.timeout(600)
# fp32 logprobs of a split model against the whole one: the row-parallel sums and the attention
# over split heads add the same terms in another order (measured: under 2e-6 on these models)
LOGPROB_TOLERANCE = 1e-4
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(model_dir: Path, tp: int, **extra: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": "tiny",
        "device": "cpu",
        "dtype": "float32",  # the exact mode
        "linear_layout": "native",  # one layout on every rank and in the reference
        "block_size": 4,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 64,
        "tensor_parallel_size": tp,
        "engine_process": "on" if tp > 1 else "off",
    }
    return ServerConfig(**{**settings, **extra})


def start(cfg: ServerConfig) -> ServingContext:
    ctx = build_serving_context(cfg)
    assert isinstance(ctx.engine, EngineProcessClient) == (cfg.tensor_parallel_size > 1)
    return ctx


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_adapters")
    return {
        "alpha": make_adapter(llama_dir, root / "alpha", r=8, seed=1, scale=30.0),
        "omega": make_adapter(
            llama_dir, root / "omega", r=4, targets=ALL_PROJECTIONS, seed=2, scale=30.0
        ),
    }


@pytest.fixture(scope="module")
def gemma_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["gemma3"]


@pytest.fixture(scope="module")
def pair(llama_dir: Path, adapters: dict[str, Path]) -> Iterator[dict[int, ServingContext]]:
    """The tiny Llama on one rank (eager) and on two (decode steps compiled on each rank, the
    all-reduces inside the graphs), with two adapters and a KV pool small enough that the
    concurrent test preempts."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    built: dict[int, ServingContext] = {}
    try:
        for tp in (1, 2):
            # two ranks with CUDA's other defaults too: async scheduling broadcasts deferred
            # tokens, which are still on the driver's device
            cuda_defaults = "on" if tp == 2 else "off"
            built[tp] = start(
                config(
                    llama_dir,
                    tp,
                    lora_modules=modules,
                    num_kv_blocks=56,
                    async_scheduling=cuda_defaults,
                    overlap_outputs=cuda_defaults,
                    torch_compile=tp == 2,
                )
            )
        yield built
    finally:
        for ctx in built.values():
            ctx.engine.shutdown()


def comparable(response: httpx.Response) -> Any:
    """The body without ids and timestamps; a stream as its events' choices in order."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(p) for p in sse_payloads(response.text) if p != "[DONE]"]
        texts: dict[int, str] = {}  # per choice: how tokens group into events is timing's
        for choice in (c for e in events for c in e["choices"]):
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        ends = sorted(
            (c["index"], c["finish_reason"])
            for e in events
            for c in e["choices"]
            if c["finish_reason"]
        )
        return texts, ends
    return {k: v for k, v in response.json().items() if k not in ("id", "created")}


def assert_same(split: Any, whole: Any, where: str = "") -> None:
    """Equal, but for floats (logprobs, scores), which may differ by LOGPROB_TOLERANCE."""
    if isinstance(whole, float) and isinstance(split, float):
        assert math.isclose(split, whole, abs_tol=LOGPROB_TOLERANCE), (where, split, whole)
    elif isinstance(whole, dict) and isinstance(split, dict):
        assert split.keys() == whole.keys(), where
        for key in whole:
            assert_same(split[key], whole[key], f"{where}.{key}")
    elif isinstance(whole, list | tuple) and isinstance(split, list | tuple):
        assert len(split) == len(whole), (where, split, whole)
        for i, (a, b) in enumerate(zip(split, whole)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert split == whole, (where, split, whole)


PROMPT = "The quick brown fox jumps over the lazy dog. A journey of"
REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": {"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
    "sampling-penalties-n2": {
        "prompt": PROMPT,
        "max_tokens": 12,
        "n": 2,
        "seed": 7,
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.9,
        "repetition_penalty": 1.3,
        "logprobs": 2,
    },
    "best-of": {"prompt": PROMPT, "max_tokens": 8, "n": 2, "best_of": 3, "seed": 3},
    "beams": {"prompt": PROMPT, "max_tokens": 8, "n": 2, "num_beams": 4, "logprobs": 1},
    "group-beams": {
        "prompt": PROMPT,
        "max_tokens": 8,
        "n": 2,
        "num_beams": 4,
        "num_beam_groups": 2,
        "diversity_penalty": 0.5,
    },
    "prompt-scoring-echo": {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
    },
    "stream-two-prompts": {
        "prompt": [PROMPT, "Hello world"],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    },
    "json-schema": {
        "prompt": "a name please:",
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
            },
        },
    },
    "adapter-alpha": {"model": "alpha", "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
    "adapter-omega-beams": {"model": "omega", "prompt": PROMPT, "max_tokens": 8, "num_beams": 3},
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
async def test_two_ranks_answer_what_one_answers(
    pair: dict[int, ServingContext], name: str
) -> None:
    whole, split = [
        comparable(await post_to(pair[tp], "/v1/completions", REQUESTS[name])) for tp in (1, 2)
    ]
    assert_same(split, whole)


async def test_adapters_change_the_split_model_as_they_change_the_whole(
    pair: dict[int, ServingContext],
) -> None:
    texts = {}
    for model in ("tiny", "alpha", "omega"):
        body = {**REQUESTS["greedy"], "model": model}
        response = await post_to(pair[2], "/v1/completions", body)
        texts[model] = response.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3, texts  # the comparison above is not of one model


async def test_a_mixed_batch_that_preempts_matches_row_for_row(
    pair: dict[int, ServingContext],
) -> None:
    bodies = [
        {"prompt": f"{PROMPT} {i}", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        for i in range(10)
    ]
    bodies[3] = {**bodies[3], "num_beams": 3}
    bodies[5] = {**bodies[5], "model": "omega"}
    bodies[7] = {**bodies[7], "temperature": 0.8, "seed": 11, "top_p": 0.9}

    async def run(tp: int) -> list[Any]:
        before = pair[tp].engine.stats()["preemptions"]
        out = await asyncio.gather(*(post_to(pair[tp], "/v1/completions", b) for b in bodies))
        assert pair[tp].engine.stats()["preemptions"] > before  # the pool is too small for all
        return [comparable(r)["choices"] for r in out]

    assert_same(await run(2), await run(1))


@pytest.fixture(scope="module")
def four_ranks(gemma_dir: Path) -> Iterator[dict[int, ServingContext]]:
    """The tiny Gemma 3 (4 heads, 2 KV heads) on 4 ranks: each KV head is held by two ranks."""
    built: dict[int, ServingContext] = {}
    try:
        for tp in (1, 4):
            built[tp] = start(config(gemma_dir, tp, num_kv_blocks=128))  # a core per 2 ranks
        yield built
    finally:
        for ctx in built.values():
            ctx.engine.shutdown()


@pytest.mark.parametrize("name", ["greedy", "beams", "prompt-scoring-echo"])
async def test_four_ranks_with_replicated_kv_heads_answer_what_one_answers(
    four_ranks: dict[int, ServingContext], name: str
) -> None:
    whole, split = [
        comparable(await post_to(four_ranks[tp], "/v1/completions", REQUESTS[name]))
        for tp in (1, 4)
    ]
    assert_same(split, whole)


def test_the_default_model_on_two_ranks_gives_hugging_faces_greedy_tokens() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=12, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    del hf
    ctx = start(config(model_dir, 2, num_kv_blocks=64, block_size=16))
    try:

        async def tokens(prompt: str) -> list[int]:
            ids = tokenizer(prompt).input_ids
            got: list[int] = []
            params = DecodingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            async for out in ctx.engine.generate(prompt, ids, params):
                got += out.token_ids
            return got

        async def run_all() -> list[list[int]]:
            return list(await asyncio.gather(*(tokens(p) for p in prompts)))

        assert asyncio.run(run_all()) == expected
    finally:
        ctx.engine.shutdown()


async def test_a_dead_rank_ends_the_engine_fails_its_requests_and_health(
    gemma_dir: Path,
) -> None:
    ctx = start(config(gemma_dir, 2, num_kv_blocks=128))
    engine = ctx.engine
    assert isinstance(engine, EngineProcessClient) and engine.pid is not None
    (follower,) = follower_pids(engine.pid)
    transport = httpx.ASGITransport(app=create_app(ctx=ctx))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            params = DecodingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            outputs = []
            started = time.monotonic()
            async for out in engine.generate("doomed", [5, 9, 13], params):
                outputs.append(out)
                if len(outputs) == 2:
                    os.kill(follower, signal.SIGKILL)
            assert time.monotonic() - started < 60, "the request waited for a dead rank"
            assert outputs[-1].request_done and outputs[-1].finish_reason == "error"
            # the engine fails its requests, then says it died and exits: the front end reads
            # that message right after the requests' last outputs, not before them
            deadline = time.monotonic() + 30
            while engine.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.alive
            await assert_engine_dead(client)
    finally:
        engine.shutdown()
    assert process_gone(engine.pid) and process_gone(follower)


@pytest.mark.parametrize(
    ("size", "reason"),
    [(3, "4 attention heads do not divide by 3"), (8, "4 attention heads do not divide by 8")],
)
def test_an_impossible_size_is_refused_before_loading(
    gemma_dir: Path, size: int, reason: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ModelLoadFailed, match=reason):
        build_serving_context(config(gemma_dir, size))
    assert time.monotonic() - started < 5  # a config.json read: no process started


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused(gemma_dir: Path) -> None:
    model = text_config(gemma_dir)
    model.num_attention_heads, model.num_key_value_heads = 12, 4
    with pytest.raises(TPConfigError, match="4 KV heads neither divide by 6"):
        check_tp_size(model, 6, torch.device("cpu"))
    check_tp_size(model, 2, torch.device("cpu"))  # 2 KV heads a rank


def test_a_tied_models_plan_from_transformers_5_17_is_split(gemma_dir: Path) -> None:
    """transformers 5.17 adds a vocabulary split of the embedding to a tied model's plan: the
    split this server makes of every model's vocabulary (an unknown style is still refused)."""
    model = text_config(gemma_dir)
    model.base_model_tp_plan = {**model.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    check_tp_size(model, 2, torch.device("cpu"))
    model.base_model_tp_plan = {**model.base_model_tp_plan, "lm_head": "sequence_parallel"}
    with pytest.raises(TPConfigError, match="plan uses sequence_parallel"):
        check_tp_size(model, 2, torch.device("cpu"))


def test_more_ranks_than_gpus_is_refused(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TPConfigError, match="needs 2 GPUs on this node; it has 1"):
        check_tp_size(text_config(gemma_dir), 2, torch.device("cuda"))


def test_the_engine_process_cannot_be_off_under_tensor_parallelism(gemma_dir: Path) -> None:
    with pytest.raises(ValidationError, match="engine_process cannot be off"):
        ServerConfig(model=str(gemma_dir), tensor_parallel_size=2, engine_process="off")


def test_each_rank_pools_its_share_of_the_kv_heads(gemma_dir: Path) -> None:
    model = text_config(gemma_dir)  # 2 KV heads
    layouts = [KVLayout.of(model, 16, torch.float32, ranks=n) for n in (1, 2, 4)]
    assert [layout.kv_heads for layout in layouts] == [2, 1, 1]
    assert layouts[1].bytes_per_block * 2 == layouts[0].bytes_per_block


async def test_a_prompt_scored_on_two_int8_ranks_is_the_floating_point_models(
    llama_dir: Path, tmp_path: Path
) -> None:
    """w8a8 split over two ranks: each rank runs a scoring prompt's tokens through its shard's
    floating-point weights (the plan's exact rows reach every rank), and the LM head scores them
    from its floating-point weight, so `echo` with logprobs is the whole fp32 model's within
    LOGPROB_TOLERANCE."""
    ctx = start(config(llama_dir, 2, quantization="w8a8", dtype="auto", cache_dir=str(tmp_path)))
    try:
        ids = ctx.tokenizer(PROMPT).input_ids
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
        response = await post_to(ctx, "/v1/completions", body)
    finally:
        ctx.engine.shutdown()
    assert response.status_code == 200, response.text
    scored = response.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [want[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert scored == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


def test_a_rendezvous_port_is_free_and_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The driver binds its rendezvous port seconds after choosing it: below the ephemeral range
    no outgoing connection takes it meanwhile."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(group, "EPHEMERAL_RANGE", ranges)
    ports = {group.free_port() for _ in range(20)}
    assert all(40000 - group.RENDEZVOUS_PORTS <= p < 40000 for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed
    monkeypatch.setattr(group, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert 32768 - group.RENDEZVOUS_PORTS <= group.free_port() < 32768
