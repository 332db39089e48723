"""The engine in a process of its own (`engine_process: on`) against the engine thread of the same
server build (`off`): the same responses for every strategy, aborts that free the KV blocks in the
other process, /metrics and /v1/engine/stats fed from there, a dead engine process that fails its
requests (never a hang) and makes /health answer 503, a start-up failure with its reason."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoding import DecodingParams
from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import build_serving_context, runs_engine_process
from server.config import ServerConfig
from server.metrics import Metrics
from server.process.client import EngineProcessClient, EngineStartupError
from server.process.metrics_relay import MetricsRelay, replay
from tests.conftest import TEST_DEVICE_NAME
from tests.reliability_helpers import (
    assert_engine_dead,
    post_to,
    process_gone,
    sse_payloads,
)

pytestmark = pytest.mark.timeout(300)


def config(model_dir: Path, engine_process: str) -> ServerConfig:
    """The process runs with CUDA's other defaults too (overlapped outputs, async scheduling):
    the thread, without them, is the reference."""
    cuda_defaults = "on" if engine_process == "on" else "off"
    return ServerConfig(
        overlap_outputs=cuda_defaults,  # type: ignore[arg-type]
        async_scheduling=cuda_defaults,  # type: ignore[arg-type]
        model=str(model_dir),
        served_model_name="tiny",
        device=TEST_DEVICE_NAME,
        engine_process=engine_process,  # type: ignore[arg-type]
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        # one layout in both: auto picks layouts by timing them at start-up, and two starts may
        # pick differently and so round differently (beam scores differ in the last digits)
        linear_layout="native",
        # the exact mode: under the CPU's int8 default a prompt served from the prefix cache can
        # take another greedy path than one computed in full, and the two engines' caches hold
        # different prompts by the time a test runs
        dtype="float32",
    )


@pytest.fixture(scope="module")
def contexts(llama_dir: Path) -> Iterator[dict[str, ServingContext]]:
    built = {mode: build_serving_context(config(llama_dir, mode)) for mode in ("off", "on")}
    assert isinstance(built["on"].engine, EngineProcessClient)
    yield built
    for ctx in built.values():
        ctx.engine.shutdown()


def comparable(response: httpx.Response) -> Any:
    """The body without what differs between any two calls (ids, timestamps)."""
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(p) for p in sse_payloads(response.text) if p != "[DONE]"]
        texts: dict[int, str] = {}  # the stream's text per choice: chunking may differ
        for event in events:
            for choice in event["choices"]:
                delta = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + delta
        finishes = [
            (c["index"], c["finish_reason"])
            for e in events
            for c in e["choices"]
            if c.get("finish_reason")
        ]
        return texts, sorted(finishes), events[-1].get("usage")
    body = response.json()
    return {k: v for k, v in body.items() if k not in ("id", "created")}


PROMPT = "The quick brown fox jumps over the lazy dog. A journey of"
REQUESTS = {
    "greedy": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
    "seeded-penalties-n2": (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 12,
            "n": 2,
            "seed": 7,
            "temperature": 0.9,
            "top_k": 20,
            "top_p": 0.9,
            "repetition_penalty": 1.3,
        },
    ),
    "best-of": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "n": 2, "best_of": 3, "seed": 3, "logprobs": 2},
    ),
    "beams": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "n": 2, "num_beams": 4}),
    "logprobs-echo-stop": (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": 3,
            "echo": True,
            "stop": ["e"],
        },
    ),
    "stream": (
        "/v1/completions",
        {
            "prompt": [PROMPT, "Hello world"],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "chat-json-schema": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a name please"}],
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
    ),
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
async def test_the_engine_process_answers_what_the_engine_thread_answers(
    contexts: dict[str, ServingContext], name: str
) -> None:
    path, body = REQUESTS[name]
    thread, process = [
        comparable(await post_to(contexts[mode], path, body)) for mode in ("off", "on")
    ]
    assert process == within_rounding(thread)


def within_rounding(answer: Any) -> Any:
    """`answer` with each float (a logprob) matched up to float32's rounding: the two engines
    may batch a step's rows differently (the process schedules ahead, and a loaded host moves
    its timing), and a float32 GEMM over other rows rounds differently in the last digits; the
    tokens and texts are compared exactly."""
    if isinstance(answer, float):
        return pytest.approx(answer, rel=1e-5, abs=1e-5)
    if isinstance(answer, dict):
        return {key: within_rounding(value) for key, value in answer.items()}
    if isinstance(answer, list | tuple):
        return type(answer)(within_rounding(value) for value in answer)
    return answer


async def test_concurrent_requests_each_get_their_own_outputs(
    contexts: dict[str, ServingContext],
) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(12)]

    async def run(mode: str) -> list[Any]:
        bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in prompts]
        responses = await asyncio.gather(
            *(post_to(contexts[mode], "/v1/completions", b) for b in bodies)
        )
        return [comparable(r)["choices"] for r in responses]

    assert await run("on") == await run("off")


async def wait_idle(ctx: ServingContext, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = ctx.engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
            if stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)


async def test_leaving_a_stream_aborts_the_request_in_the_engine_process(
    contexts: dict[str, ServingContext],
) -> None:
    ctx = contexts["on"]
    params = DecodingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    before = ctx.engine.stats()["tokens_generated"]
    stream = ctx.engine.generate("abandoned", [5, 9, 13], params)
    seen = 0
    async for out in stream:
        seen += len(out.token_ids)
        if seen >= 3:
            break
    await stream.aclose()
    stats = await wait_idle(ctx)  # every block back in the pool, in the other process
    assert stats["tokens_generated"] - before < 400  # stopped, not run to its end
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


async def test_metrics_and_stats_come_from_the_engine_process(
    contexts: dict[str, ServingContext],
) -> None:
    ctx = contexts["on"]
    metrics = ctx.metrics
    assert metrics is not None

    def successes() -> float:
        body, _ = metrics.render()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines()
            if line.startswith("beamline:request_success_total{")
        )

    before_ok, before_steps = successes(), ctx.engine.stats()["steps"]
    response = await post_to(ctx, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "n": 3})
    assert response.status_code == 200
    # the request's last output carried the metric calls of its step: already replayed here
    assert successes() == before_ok + 1  # one engine request of three rows
    assert ctx.engine.stats()["steps"] > before_steps
    text = metrics.render()[0].decode()
    assert 'num_gpu_blocks="256"' in text  # the pool's shape, published at start-up


def test_metrics_relay_records_calls_and_replays_them_on_real_metrics() -> None:
    relay = MetricsRelay()
    relay.observe_step(num_tokens=7, batch_size=3)
    relay.record_preemptions(2)
    with pytest.raises(AttributeError):
        relay.not_a_metric  # noqa: B018  (a typo must not pass silently)
    events = relay.drain()
    assert [e[0] for e in events] == ["observe_step", "record_preemptions"]
    assert relay.drain() == []
    metrics = Metrics("m")
    replay(events, metrics)
    text = metrics.render()[0].decode()
    assert 'beamline:num_preemptions_total{model_name="m"} 2.0' in text


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False)],
)
def test_engine_process_auto_is_on_for_cuda_only(setting: str, device: str, expected: bool) -> None:
    assert runs_engine_process(setting, device) is expected


async def test_a_dead_engine_process_fails_open_requests_and_health(llama_dir: Path) -> None:
    ctx = build_serving_context(config(llama_dir, "on"))
    engine = ctx.engine
    assert isinstance(engine, EngineProcessClient) and engine.pid is not None
    app = create_app(ctx=ctx)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            params = DecodingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            outputs = []
            async for out in engine.generate("doomed", [5, 9, 13], params):
                outputs.append(out)
                if len(outputs) == 2:
                    os.kill(engine.pid, signal.SIGKILL)
            assert outputs[-1].request_done and outputs[-1].finish_reason == "error"
            assert "engine process exited" in (outputs[-1].error or "")
            assert not engine.alive
            await assert_engine_dead(client)
    finally:
        engine.shutdown()
    assert process_gone(engine.pid)


def test_a_model_that_fails_to_load_in_the_engine_process_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    client = EngineProcessClient(config(broken, "on"))
    with pytest.raises(EngineStartupError) as failed:
        client.start()
    assert str(failed.value)  # the child's exception, not just an exit code
    assert "exit code" not in str(failed.value)
    assert client.pid is not None and process_gone(client.pid)
