"""Prometheus metrics of one engine, named like vLLM's so that its dashboards translate.

Every metric is `beamline:<vLLM name>` with a `model_name` label. Each `Metrics` owns its own
`CollectorRegistry` (no process-global state), so tests and several engines in one process never
collide. Label values are checked against closed sets: an unbounded label would make Prometheus
grow a new series for every typo.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from server.request_metrics import (  # noqa: F401 - FAILURE_REASONS, FINISHED_REASONS: here too
    FAILURE_REASONS,
    FINISHED_REASONS,
    LATENCY_BUCKETS,
    PREFIX,
    TOKEN_BUCKETS,
    UNKNOWN_STRATEGY,
    RequestMetrics,
    check_label,
)

MASK_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# seconds of work per second of audio: 0.005 (a GPU's batch) to 10 (a CPU behind a queue)
REAL_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
AUDIO_TASKS = ("transcribe", "translate")

# The Gateway API Inference Extension's model-server protocol: its Endpoint Picker reads these
# gauges, by default under vLLM's names. They are served under those names too (only these: the
# rest of the metrics are not doubled), next to beamline's own.
PROTOCOL_PREFIX = "vllm:"
PROTOCOL_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")
CACHE_CONFIG_INFO = PROTOCOL_PREFIX + "cache_config_info"
# The protocol's LoRA gauge: its labels name the adapters in use; the value is when they were set.
LORA_REQUESTS_INFO = PROTOCOL_PREFIX + "lora_requests_info"


class Metrics:
    """All metrics of one server; the engine calls the `record_*`/`observe_*` methods. Requests
    are counted per model (`model_name`: the served model's, or an extra model's that requests
    name); the engine's own state (batch, KV cache, speculation) under the served model's."""

    def __init__(self, model_name: str, extra_models: Sequence[str] = ()) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        m = (model_name,)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ("model_name", *labels), registry=self.registry)

        def gauge(name: str, doc: str, prefix: str = PREFIX) -> Gauge:
            return Gauge(prefix + name, doc, ("model_name",), registry=self.registry).labels(*m)

        def histogram(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(
                PREFIX + name, doc, ("model_name",), buckets=buckets, registry=self.registry
            ).labels(*m)

        self._running = gauge("num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self._protocol = {  # the same values under the protocol's names (PROTOCOL_GAUGES)
            name: gauge(name, f"{doc} (Gateway API Inference Extension protocol)", PROTOCOL_PREFIX)
            for name, doc in (
                ("num_requests_waiting", "Requests waiting to be scheduled"),
                ("num_requests_running", "Requests in the running batch"),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)"),
            )
        }
        # LoRA's series exist once a server serves adapters (made at their first use)
        self._lora_info: Gauge | None = None
        self._lora_counter: Counter | None = None
        self._cache_config = Gauge(
            CACHE_CONFIG_INFO,
            "KV cache configuration (value 1): block size in tokens and blocks in the pool.",
            ("model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=self.registry,
        )
        self._batch_size = gauge("batch_size", "Sequences in the last engine step.")
        self._compiled_step = gauge(
            "decode_step_compiled",
            "1 while decode steps run the compiled step; 0: eager (not compiled, or compiling "
            "beside serving).",
        )
        self._preemptions = counter("num_preemptions", "Sequences preempted.").labels(*m)
        self._iteration_tokens = histogram(
            "iteration_tokens", "Tokens processed per engine step.", TOKEN_BUCKETS
        )
        self._requests = RequestMetrics(self.registry, (model_name, *extra_models))
        self._prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(*m)
        self._prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        ).labels(*m)
        # Structured outputs: grammar compiles (server/grammars.py) and per-step masks (engine).
        self._grammar_compiles = counter(
            "grammar_compiles", "Grammars compiled (cache misses that compiled)."
        ).labels(*m)
        self._grammar_failures = counter(
            "grammar_compile_failures", "Grammars that failed to compile or timed out."
        ).labels(*m)
        self._grammar_hits = counter(
            "grammar_cache_hits", "Grammar requests served from the compiled-grammar cache."
        ).labels(*m)
        self._grammar_compile_time = histogram(
            "grammar_compile_seconds", "Time to compile one grammar.", MASK_BUCKETS
        )
        self._mask_time = histogram(
            "grammar_mask_seconds",
            "Time per engine step to build the allowed-token mask of its constrained rows.",
            MASK_BUCKETS,
        )
        # speculation (n-gram or draft-model drafts), under vLLM's spec_decode names
        self._spec_drafts = counter(
            "spec_decode_num_drafts", "Rows' drafts verified (one per drafting row per step)."
        ).labels(*m)
        self._spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        ).labels(*m)
        self._spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        ).labels(*m)
        # Speech (the audio routes): how much audio, and how fast against its own length
        self._audio_seconds = counter("audio_seconds", "Seconds of audio decoded.", "task")
        self._real_time = histogram(
            "audio_real_time_factor",
            "Per upload: seconds from its arrival to its transcript over its audio's seconds.",
            REAL_TIME_BUCKETS,
        )
        for task in AUDIO_TASKS:
            self._audio_seconds.labels(model_name, task)

    def set_scheduler_state(self, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be a fraction in [0, 1], got {kv_cache_usage}")
        for name, value in (
            ("num_requests_running", running),
            ("num_requests_waiting", waiting),
            ("kv_cache_usage_perc", kv_cache_usage),
        ):
            self._protocol[name].set(value)
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_usage.set(kv_cache_usage)

    def set_decode_step_compiled(self, compiled: bool) -> None:
        self._compiled_step.set(int(compiled))

    def set_cache_config(self, *, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """The KV pool's shape, as `vllm:cache_config_info` labels (`num_gpu_blocks` is the pool
        size on any device)."""
        self._cache_config.clear()
        self._cache_config.labels(
            self.model_name, str(block_size), str(num_blocks), str(prefix_caching)
        ).set(1)

    def set_lora_state(
        self, *, max_lora: int, running: Sequence[str], waiting: Sequence[str]
    ) -> None:
        """The adapters in use (one series: the previous label set is dropped)."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                LORA_REQUESTS_INFO,
                "LoRA adapters of running and waiting requests (comma-separated names) and how "
                "many can be resident at once; the value is the time they were last set (Gateway "
                "API Inference Extension protocol).",
                ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=self.registry,
            )
        self._lora_info.clear()
        labels = (str(max_lora), ",".join(running), ",".join(waiting))
        self._lora_info.labels(*labels).set(time.time())

    def record_lora_request(self, adapter: str) -> None:
        if self._lora_counter is None:
            self._lora_counter = Counter(
                PREFIX + "lora_requests_total",
                "Requests admitted per LoRA adapter.",
                ("model_name", "lora_name"),
                registry=self.registry,
            )
        self._lora_counter.labels(self.model_name, adapter).inc()

    def observe_step(self, *, num_tokens: int, batch_size: int) -> None:
        self._iteration_tokens.observe(num_tokens)
        self._batch_size.set(batch_size)

    def record_spec_decode(self, *, drafted: int, accepted: int) -> None:
        self._spec_drafts.inc()
        self._spec_draft_tokens.inc(drafted)
        self._spec_accepted_tokens.inc(accepted)

    def record_preemptions(self, n: int = 1) -> None:
        self._preemptions.inc(n)

    def record_first_token(self, ttft_s: float, model: str | None = None) -> None:
        self._requests.of(model).ttft.observe(ttft_s)

    def record_inter_token(self, itl_s: float, model: str | None = None) -> None:
        self._requests.of(model).itl.observe(itl_s)

    def record_request_success(self, *, model: str | None = None, **finished: Any) -> None:
        """A request of `model` (None: the served model) finished: `finished` holds
        RequestMetrics.success's fields (strategy, finished_reason, tokens, times)."""
        self._requests.success(model, **finished)

    def record_request_failure(
        self,
        *,
        reason: str,
        strategy: str = UNKNOWN_STRATEGY,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        model: str | None = None,
    ) -> None:
        """Count a failed request; the tokens it already cost still count as work done."""
        self._requests.failure(model, reason, strategy, prompt_tokens, generation_tokens)

    def record_prefix_cache(self, *, queries: int, hits: int) -> None:
        if not 0 <= hits <= queries:
            raise ValueError(f"prefix cache hits ({hits}) must be within [0, queries={queries}]")
        self._prefix_queries.inc(queries)
        self._prefix_hits.inc(hits)

    def record_grammar_compile(self, seconds: float, *, ok: bool) -> None:
        """A grammar compiled (or failed to) in `seconds`."""
        self._grammar_compile_time.observe(seconds)
        (self._grammar_compiles if ok else self._grammar_failures).inc()

    def record_grammar_cache_hit(self) -> None:
        self._grammar_hits.inc()

    def observe_constraint_mask(self, seconds: float) -> None:
        self._mask_time.observe(seconds)

    def record_audio(self, *, task: str, audio_s: float, elapsed_s: float) -> None:
        """An upload's transcript done: its audio's seconds, the seconds it took."""
        check_label(task, AUDIO_TASKS, "task")
        self._audio_seconds.labels(self.model_name, task).inc(audio_s)
        if audio_s > 0:
            self._real_time.observe(elapsed_s / audio_s)

    def render(self) -> tuple[bytes, str]:
        """Body and content type of the Prometheus text exposition, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
