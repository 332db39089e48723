"""The Gateway API Inference Extension's model-server protocol: the gauges its Endpoint Picker
reads, under vLLM's default names, beside beamline's own, and how they move under load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.metrics import CACHE_CONFIG_INFO, PROTOCOL_GAUGES, PROTOCOL_PREFIX, Metrics
from tests.conftest import make_engine, serving_context


def families(text: str) -> dict[str, tuple[str, list]]:
    """Family name -> (type, samples)."""
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def protocol_values(text: str) -> dict[str, float]:
    fams = families(text)
    return {name: fams[PROTOCOL_PREFIX + name][1][0].value for name in PROTOCOL_GAUGES}


def test_protocol_gauges_are_exposed_once_each_beside_beamlines_own() -> None:
    m = Metrics("tiny")
    m.set_scheduler_state(running=3, waiting=5, kv_cache_usage=0.25)
    m.set_cache_config(block_size=16, num_blocks=1024, prefix_caching=True)
    fams = families(m.render()[0].decode())
    assert {n for n in fams if n.startswith(PROTOCOL_PREFIX)} == {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        CACHE_CONFIG_INFO,
    }  # only these: beamline's other metrics are not doubled
    for name, expected in (
        ("num_requests_running", 3),
        ("num_requests_waiting", 5),
        ("kv_cache_usage_perc", 0.25),
    ):
        kind, samples = fams[PROTOCOL_PREFIX + name]
        assert kind == "gauge"
        assert [(s.labels, s.value) for s in samples] == [({"model_name": "tiny"}, expected)]
        assert fams["beamline:" + name][1][0].value == expected  # beamline's own, same value
    kind, samples = fams[CACHE_CONFIG_INFO]
    assert kind == "gauge"
    assert [(s.labels, s.value) for s in samples] == [
        (
            {
                "model_name": "tiny",
                "block_size": "16",
                "num_gpu_blocks": "1024",
                "enable_prefix_caching": "True",
            },
            1.0,
        )
    ]


async def test_protocol_gauges_move_under_load_and_return_to_zero(llama_dir: Path) -> None:
    """Eight requests against max_num_seqs 2: the queue grows, the KV cache fills, and both
    come back to zero once the load is gone."""
    engine = make_engine(llama_dir, num_blocks=64, block_size=4, max_num_seqs=2)
    ctx = serving_context(engine)
    app = create_app(ctx=ctx)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            first = families((await client.get("/metrics")).text)
            info = first[CACHE_CONFIG_INFO][1][0].labels
            assert info["block_size"] == "4" and info["num_gpu_blocks"] == "64"
            body = {"prompt": "Hello there", "max_tokens": 40, "ignore_eos": True}
            load = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(8)
            ]
            seen: list[dict[str, float]] = []
            while not all(t.done() for t in load):
                seen.append(protocol_values((await client.get("/metrics")).text))
                await asyncio.sleep(0.005)
            assert [t.result().status_code for t in load] == [200] * 8
            after = protocol_values((await client.get("/metrics")).text)
    finally:
        ctx.engine.shutdown()
    assert max(s["num_requests_waiting"] for s in seen) >= 3
    assert max(s["num_requests_running"] for s in seen) == 2
    assert all(s["num_requests_running"] <= 2 for s in seen)
    assert max(s["kv_cache_usage_perc"] for s in seen) > 0
    assert after == {
        "num_requests_waiting": 0,
        "num_requests_running": 0,
        "kv_cache_usage_perc": 0,
    }
