"""The per-request Prometheus series (server/metrics.py), one set per model: a request counts
under the `model_name` of the model that answered it, the served model's or an extra model's
(engine/fusion.py). Label values are checked against closed sets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from decoding.params import STRATEGIES

PREFIX = "beamline:"
FAILURE_REASONS = ("validation", "aborted", "overloaded", "internal")
FINISHED_REASONS = ("stop", "length", "no_legal_token")  # engine reasons (decoding/constraints.py)
UNKNOWN_STRATEGY = "unknown"  # a failure before the request was parsed
# 1 ms (a CPU decode step of a tiny model) up to 10 min (a long beam search behind a queue).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_BUCKETS = tuple(float(2**i) for i in range(16))  # 1 .. 32768 tokens


def check_label(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


@dataclass(frozen=True)
class RequestSeries:
    """One model's series of the per-request histograms and token counters."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    request_prompt: Histogram
    request_generation: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter


class RequestMetrics:
    """Finished and failed requests, their tokens and latencies, by model. Every label
    combination exists at 0 from the start, so rate() sees the first event."""

    def __init__(self, registry: CollectorRegistry, models: Sequence[str]) -> None:
        def histogram(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(
                PREFIX + name, doc, ("model_name",), buckets=buckets, registry=registry
            )

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ("model_name", *labels), registry=registry)

        families = (
            histogram("time_to_first_token_seconds", "Time to first token."),
            histogram("inter_token_latency_seconds", "Time between consecutive tokens."),
            histogram("e2e_request_latency_seconds", "Arrival to last token."),
            histogram("request_queue_time_seconds", "Arrival to first scheduled."),
            histogram(
                "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
            ),
            histogram(
                "request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS
            ),
            counter("prompt_tokens", "Prefill tokens processed."),
            counter("generation_tokens", "Tokens generated."),
        )
        self.models = tuple(models)  # the served model first
        self.series = {
            name: RequestSeries(*(f.labels(name) for f in families))  # type: ignore[arg-type]
            for name in self.models
        }
        self._success = counter(
            "request_success", "Finished requests.", "finished_reason", "strategy"
        )
        self._failure = counter("request_failure", "Failed requests.", "reason", "strategy")
        for name in self.models:
            for strategy in STRATEGIES:
                for finished in FINISHED_REASONS:
                    self._success.labels(name, finished, strategy)
            for strategy_label in (*STRATEGIES, UNKNOWN_STRATEGY):
                for reason in FAILURE_REASONS:
                    self._failure.labels(name, reason, strategy_label)

    def name(self, model: str | None) -> str:
        """The `model_name` of a request of `model` (None: the served model)."""
        if model is None:
            return self.models[0]
        check_label(model, self.models, "model")
        return model

    def of(self, model: str | None) -> RequestSeries:
        return self.series[self.name(model)]

    def success(
        self,
        model: str | None,
        *,
        strategy: str,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        queue_time_s: float,
        e2e_s: float,
    ) -> None:
        check_label(strategy, STRATEGIES, "strategy")
        check_label(finished_reason, FINISHED_REASONS, "finished_reason")
        name = self.name(model)
        self._success.labels(name, finished_reason, strategy).inc()
        series = self._tokens(name, prompt_tokens, generation_tokens)
        series.request_prompt.observe(prompt_tokens)
        series.request_generation.observe(generation_tokens)
        series.queue_time.observe(queue_time_s)
        series.e2e.observe(e2e_s)

    def failure(
        self,
        model: str | None,
        reason: str,
        strategy: str,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        check_label(reason, FAILURE_REASONS, "failure reason")
        check_label(strategy, (*STRATEGIES, UNKNOWN_STRATEGY), "strategy")
        name = self.name(model)
        self._failure.labels(name, reason, strategy).inc()
        self._tokens(name, prompt_tokens, generation_tokens)

    def _tokens(self, name: str, prompt_tokens: int, generation_tokens: int) -> RequestSeries:
        series = self.series[name]
        series.prompt_tokens.inc(prompt_tokens)
        series.generation_tokens.inc(generation_tokens)
        return series
