"""Exact values of the Prometheus exposition after a known sequence of engine events."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from decoding.params import STRATEGIES
from server.metrics import FAILURE_REASONS, FINISHED_REASONS, Metrics

Labels = tuple[tuple[str, str], ...]


def scrape(metrics: Metrics) -> dict[str, dict[Labels, float]]:
    """Sample name -> {sorted labels -> value}, parsed back from the text exposition."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples: dict[str, dict[Labels, float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted({"model_name": "tiny", **labels}.items()))]


@pytest.fixture
def metrics() -> Metrics:
    m = Metrics("tiny")
    m.set_scheduler_state(running=3, waiting=2, kv_cache_usage=0.25)
    m.observe_step(num_tokens=40, batch_size=3)
    m.observe_step(num_tokens=3, batch_size=4)
    m.record_preemptions()
    m.record_preemptions(2)
    m.record_first_token(0.05)
    m.record_first_token(0.15)
    m.record_inter_token(0.02)
    m.record_request_success(
        strategy="beam", finished_reason="stop", prompt_tokens=10, generation_tokens=7,
        queue_time_s=0.5, e2e_s=2.0,
    )  # fmt: skip
    m.record_request_success(
        strategy="greedy", finished_reason="length", prompt_tokens=4, generation_tokens=16,
        queue_time_s=0.0, e2e_s=1.0,
    )  # fmt: skip
    m.record_request_failure(
        reason="aborted", strategy="sample", prompt_tokens=5, generation_tokens=2
    )
    m.record_request_failure(reason="validation")
    m.record_prefix_cache(queries=32, hits=16)
    return m


def test_counters(metrics: Metrics) -> None:
    s = scrape(metrics)
    assert value(s, "beamline:prompt_tokens_total") == 10 + 4 + 5
    assert value(s, "beamline:generation_tokens_total") == 7 + 16 + 2
    assert value(s, "beamline:num_preemptions_total") == 3
    assert value(s, "beamline:prefix_cache_queries_total") == 32
    assert value(s, "beamline:prefix_cache_hits_total") == 16
    success = "beamline:request_success_total"
    assert value(s, success, strategy="beam", finished_reason="stop") == 1
    assert value(s, success, strategy="greedy", finished_reason="length") == 1
    assert value(s, success, strategy="greedy", finished_reason="stop") == 0
    assert sum(s[success].values()) == 2
    failure = "beamline:request_failure_total"
    assert value(s, failure, reason="aborted", strategy="sample") == 1
    assert value(s, failure, reason="validation", strategy="unknown") == 1
    assert sum(s[failure].values()) == 2


def test_every_label_combination_is_exposed_from_the_start() -> None:
    s = scrape(Metrics("tiny"))
    assert len(s["beamline:request_success_total"]) == len(STRATEGIES) * len(FINISHED_REASONS)
    assert len(s["beamline:request_failure_total"]) == (len(STRATEGIES) + 1) * len(FAILURE_REASONS)
    assert value(s, "beamline:generation_tokens_total") == 0


def test_requests_count_under_the_model_that_answered_them() -> None:
    """An extra model that answers requests has its own per-request series from the start; the
    engine's gauges stay under the served model's name; an unknown model name is refused."""
    m = Metrics("tiny", ["second"])
    done = dict(finished_reason="length", prompt_tokens=4, queue_time_s=0.1, e2e_s=1.0)
    m.record_request_success(strategy="greedy", generation_tokens=7, model="second", **done)
    m.record_request_success(strategy="greedy", generation_tokens=2, **done)
    m.record_request_failure(reason="aborted", generation_tokens=3, model="second")
    m.record_first_token(0.5, "second")
    m.observe_step(num_tokens=4, batch_size=2)
    s = scrape(m)
    second = {"model_name": "second"}
    assert value(s, "beamline:generation_tokens_total", **second) == 10
    assert value(s, "beamline:generation_tokens_total") == 2
    finished = dict(finished_reason="length", strategy="greedy")
    assert value(s, "beamline:request_success_total", **second, **finished) == 1
    assert value(s, "beamline:request_failure_total", **second, reason="aborted",
                 strategy="unknown") == 1  # fmt: skip
    assert value(s, "beamline:time_to_first_token_seconds_count", **second) == 1
    assert value(s, "beamline:time_to_first_token_seconds_count") == 0
    assert len(s["beamline:request_success_total"]) == 2 * len(STRATEGIES) * len(FINISHED_REASONS)
    assert list(s["beamline:batch_size"]) == [(("model_name", "tiny"),)]
    with pytest.raises(ValueError, match="unknown model 'third'"):
        m.record_first_token(0.5, "third")


def test_gauges(metrics: Metrics) -> None:
    s = scrape(metrics)
    assert value(s, "beamline:num_requests_running") == 3
    assert value(s, "beamline:num_requests_waiting") == 2
    assert value(s, "beamline:kv_cache_usage_perc") == 0.25
    assert value(s, "beamline:batch_size") == 4  # the last step's


@pytest.mark.parametrize(
    ("name", "count", "total"),
    [
        ("beamline:iteration_tokens", 2, 43),
        ("beamline:time_to_first_token_seconds", 2, 0.2),
        ("beamline:inter_token_latency_seconds", 1, 0.02),
        ("beamline:e2e_request_latency_seconds", 2, 3.0),
        ("beamline:request_queue_time_seconds", 2, 0.5),
        ("beamline:request_prompt_tokens", 2, 14),
        ("beamline:request_generation_tokens", 2, 23),
    ],
)
def test_histograms(metrics: Metrics, name: str, count: int, total: float) -> None:
    s = scrape(metrics)
    assert value(s, name + "_count") == count
    assert value(s, name + "_sum") == pytest.approx(total)
    assert value(s, name + "_bucket", le="+Inf") == count


def test_histogram_buckets_place_observations() -> None:
    m = Metrics("tiny")
    m.record_first_token(0.0009)
    m.record_first_token(0.05)
    m.record_first_token(90.0)
    m.observe_step(num_tokens=8192, batch_size=1)
    s = scrape(m)
    ttft = "beamline:time_to_first_token_seconds_bucket"
    assert value(s, ttft, le="0.001") == 1
    assert value(s, ttft, le="0.05") == 2
    assert value(s, ttft, le="60.0") == 2
    assert value(s, ttft, le="120.0") == 3
    assert value(s, "beamline:iteration_tokens_bucket", le="4096.0") == 0
    assert value(s, "beamline:iteration_tokens_bucket", le="8192.0") == 1


def test_instances_do_not_share_state() -> None:
    a, b = Metrics("a"), Metrics("b")
    a.record_preemptions(5)
    s = scrape(b)
    assert s["beamline:num_preemptions_total"] == {(("model_name", "b"),): 0}


def succeed(m: Metrics, **overrides: object) -> None:
    args: dict = dict(
        strategy="greedy", finished_reason="stop", prompt_tokens=1, generation_tokens=1,
        queue_time_s=0.0, e2e_s=0.0,
    )  # fmt: skip
    m.record_request_success(**{**args, **overrides})


@pytest.mark.parametrize(
    "call",
    [
        lambda m: succeed(m, strategy="nucleus"),
        lambda m: succeed(m, strategy="unknown"),
        lambda m: succeed(m, finished_reason="eos"),
        lambda m: m.record_request_failure(reason="timeout"),
        lambda m: m.record_request_failure(reason="internal", strategy="nucleus"),
        lambda m: m.set_scheduler_state(running=0, waiting=0, kv_cache_usage=50.0),
        lambda m: m.record_prefix_cache(queries=4, hits=5),
    ],
)
def test_bad_values_are_rejected_and_record_nothing(call: Callable[[Metrics], None]) -> None:
    m = Metrics("tiny")
    before = scrape(m)
    with pytest.raises(ValueError):
        call(m)
    after = scrape(m)
    for name in ("beamline:request_success_total", "beamline:request_failure_total"):
        assert after[name] == before[name]
    assert value(after, "beamline:prompt_tokens_total") == 0
    assert value(after, "beamline:kv_cache_usage_perc") == 0
