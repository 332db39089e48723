"""What one run measured: the engine's counters read before and after it (over HTTP from
GET /v1/engine/stats and /metrics, in process from the engine itself) and its row of the report
(`ModeResult`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.stats import RequestResult


@dataclass(frozen=True)
class Counters:
    """Engine counters since start-up (/v1/engine/stats) and the cumulative buckets of the
    tokens-per-step histogram (/metrics), read before and after a run."""

    steps: int
    tokens_generated: int
    tokens_computed: int
    max_seqs_in_step: int
    iteration_tokens: dict[float, float]  # upper bound -> cumulative count
    busy_seconds: float = 0.0  # wall time inside engine steps that did work

    @classmethod
    def parse(cls, stats: dict[str, Any], metrics_text: str) -> Counters:
        from prometheus_client.parser import text_string_to_metric_families

        buckets: dict[float, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            if family.name.endswith("iteration_tokens"):
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        buckets[float(s.labels["le"])] = s.value
        return cls(
            int(stats["steps"]),
            int(stats["tokens_generated"]),
            int(stats["tokens_computed"]),
            int(stats["max_seqs_in_step"]),
            buckets,
            float(stats.get("busy_seconds", 0.0)),
        )


def tokens_per_step_histogram(before: Counters, after: Counters) -> dict[str, int]:
    """Steps of the run by tokens in the step, "lo-hi" (both included) -> steps; not cumulative,
    empty buckets left out."""
    out: dict[str, int] = {}
    previous, lower = 0.0, 0.0
    for le in sorted(after.iteration_tokens):
        cumulative = after.iteration_tokens[le] - before.iteration_tokens.get(le, 0.0)
        if cumulative - previous > 0:
            lo, hi = f"{int(lower) + 1}", "inf" if le == float("inf") else f"{int(le)}"
            out[lo if lo == hi else f"{lo}-{hi}"] = int(cumulative - previous)
        previous, lower = cumulative, le
    return out


def bucket_bounds(label: str) -> tuple[float, float]:
    lo, _, hi = label.partition("-")
    return float(lo), float(hi or lo)


@dataclass
class ModeResult:
    mode: str  # in-process | http-stream | http-nonstream
    concurrency: int
    requests: int
    ok: int
    output_tokens: int  # as the client (or the emit callback) counted them
    wall_s: float
    out_tok_s: float
    steps: int
    steps_per_s: float
    rows_per_step: float  # tokens generated / steps
    tokens_generated: int
    ms_per_step: float  # wall / steps
    # share of the run's wall time the engine spent inside its steps (/v1/engine/stats
    # busy_seconds): the rest it waited for work; a step's time includes its waits for the GIL
    in_steps: float | None = None
    step_ms_mean: float | None = None  # timed steps (in process only)
    step_ms_median: float | None = None
    rows_per_step_exact: float | None = None  # from the rows histogram (in process only)
    tokens_computed: int = 0
    max_rows_since_start: int = 0
    tokens_per_step: dict[str, int] = field(default_factory=dict)
    # over HTTP: mean requests in the engine and admitted by the front end, from GET
    # /v1/engine/stats every --poll-s; the event loop answers it, so its busiest moments (a wave
    # of requests ending and starting) are under-sampled
    in_engine_mean: float | None = None
    in_flight_mean: float | None = None
    errors: list[str] = field(default_factory=list)
    server_cpu: dict[str, Any] = field(default_factory=dict)  # in process: this process
    client_cpu_s: float | None = None
    client_cores: float | None = None
    others_cores: float | None = None  # other processes of the machine during the run
    # filled in by compare(): the engine alone on the same steps (StepModel)
    engine_alone_s: float | None = None
    engine_alone_ms_per_step: float | None = None
    frontend_share: float | None = None
    # the same from CPU seconds, which other processes on the machine hardly change: against the
    # engine thread's own (low) and against the engine thread's plus the event loop's (high)
    cpu_share_low: float | None = None
    cpu_share_high: float | None = None
    rows_ratio: float | None = None

    @property
    def label(self) -> str:
        return f"{self.mode} c={self.concurrency}"


def mode_result(
    mode: str,
    concurrency: int,
    results: Sequence[RequestResult],
    wall_s: float,
    before: Counters,
    after: Counters,
) -> ModeResult:
    steps = after.steps - before.steps
    generated = after.tokens_generated - before.tokens_generated
    out_tokens = sum(r.output_tokens for r in results if r.success)
    errors = sorted({r.error for r in results if not r.success})[:5]
    return ModeResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(results),
        ok=sum(r.success for r in results),
        output_tokens=out_tokens,
        wall_s=wall_s,
        out_tok_s=out_tokens / wall_s if wall_s else 0.0,
        steps=steps,
        steps_per_s=steps / wall_s if wall_s else 0.0,
        rows_per_step=generated / steps if steps else 0.0,
        tokens_generated=generated,
        ms_per_step=wall_s / steps * 1e3 if steps else 0.0,
        in_steps=(after.busy_seconds - before.busy_seconds) / wall_s if wall_s else None,
        tokens_computed=after.tokens_computed - before.tokens_computed,
        max_rows_since_start=after.max_seqs_in_step,
        tokens_per_step=tokens_per_step_histogram(before, after),
        errors=errors,
    )
