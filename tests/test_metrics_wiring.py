"""After a known set of requests, /metrics reports exactly what was sent."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.api.serving import ServingContext


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


async def test_counters_and_histograms_match_the_requests_sent(
    client: httpx.AsyncClient, tiny_ctx: ServingContext
) -> None:
    lengths = [4, 5, 6]
    prompt_tokens = 0
    for n in lengths:
        r = await client.post(
            "/v1/completions",
            json={"prompt": "Hello world", "max_tokens": n, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
    r = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3, "temperature": 0.8, "seed": 1, "ignore_eos": True},
    )
    prompt_tokens += r.json()["usage"]["prompt_tokens"]
    for bad in ({"prompt": "x", "temperature": -1}, {"prompt": ""}):
        assert (await client.post("/v1/completions", json=bad)).status_code == 400

    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    generated = sum(lengths) + 3
    assert (
        m[
            (
                "beamline:request_success_total",
                (("finished_reason", "length"), ("strategy", "greedy")),
            )
        ]
        == 3
    )
    assert (
        m[
            (
                "beamline:request_success_total",
                (("finished_reason", "length"), ("strategy", "sample")),
            )
        ]
        == 1
    )
    assert (
        m[("beamline:request_failure_total", (("reason", "validation"), ("strategy", "unknown")))]
        == 2
    )
    assert m[("beamline:generation_tokens_total", ())] == generated
    assert m[("beamline:prompt_tokens_total", ())] == prompt_tokens
    assert m[("beamline:e2e_request_latency_seconds_count", ())] == 4
    assert m[("beamline:request_queue_time_seconds_count", ())] == 4
    assert m[("beamline:time_to_first_token_seconds_count", ())] == 4
    assert m[("beamline:inter_token_latency_seconds_count", ())] == generated - 4
    assert m[("beamline:request_generation_tokens_sum", ())] == generated
    stats = tiny_ctx.engine.engine.stats
    assert m[("beamline:iteration_tokens_count", ())] == stats.steps
    assert m[("beamline:iteration_tokens_sum", ())] == stats.tokens_computed
    assert m[("beamline:num_requests_running", ())] == 0
    assert m[("beamline:kv_cache_usage_perc", ())] == 0.0


async def test_ready_route(client: httpx.AsyncClient) -> None:
    assert (await client.get("/ready")).status_code == 200
