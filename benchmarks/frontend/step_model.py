"""The reference: the engine alone on a run's steps, fitted on timed in-process steps
(`StepModel`), and each run's front-end share, CPU bounds and rows ratio against it (`compare`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.frontend.cpu import ENGINE, EVENT_LOOP
from benchmarks.frontend.results import ModeResult, bucket_bounds

Step = tuple[int, int, float]  # one in-process step: tokens computed, rows sampled, seconds


@dataclass(frozen=True)
class StepModel:
    """Seconds the engine alone needs for a run's steps, from the in-process runs:

        sum over the run's steps of f(rows) + b x (tokens computed - rows sampled)

    f, a decode step's time by width, goes through one anchor per in-process run (mean rows and
    mean time of its decode-only steps), linear between anchors and beyond them; b is the median
    extra time per prefill token of the steps that also prefilled. Anchors, not one straight
    line: a step is not linear in its rows (tiny model, one thread: 84 us per row at 64 rows,
    72 at 128, 105 at 256). The HTTP counters give totals and a tokens-per-step histogram, not
    each step's rows: `seconds` spreads the rows over the histogram's buckets."""

    anchors: list[tuple[float, float]]  # (rows, seconds of a decode step), by rows
    prefill_token_s: float
    num_steps: int

    @classmethod
    def fit(cls, runs: Sequence[Sequence[Step]]) -> StepModel:
        anchors = []
        for steps in runs:
            decode = [(rows, sec) for tokens, rows, sec in steps if tokens == rows and rows]
            if decode:
                anchors.append(
                    (statistics.fmean(r for r, _ in decode), statistics.fmean(t for _, t in decode))
                )
        model = cls(sorted(anchors), 0.0, sum(len(steps) for steps in runs))
        extra = [
            (sec - model.decode_s(rows)) / (tokens - rows)
            for steps in runs
            for tokens, rows, sec in steps
            if tokens > rows
        ]
        return cls(model.anchors, statistics.median(extra) if extra else 0.0, model.num_steps)

    def decode_s(self, rows: float) -> float:
        """f(rows): linear through the anchors (the nearest segment beyond them)."""
        a = self.anchors
        if not a:
            return 0.0
        if len(a) == 1:
            return a[0][1] * rows / a[0][0]
        i = 1
        while i < len(a) - 1 and rows > a[i][0]:
            i += 1
        (r0, t0), (r1, t1) = a[i - 1], a[i]
        return max(0.0, t0 + (t1 - t0) * (rows - r0) / (r1 - r0) if r1 != r0 else t0)

    def seconds(
        self,
        steps: int,
        tokens: int,
        rows: int,
        histogram: dict[str, int] | None = None,
        max_rows: int | None = None,
    ) -> float:
        """Engine-alone seconds of `steps` steps that computed `tokens` tokens and sampled `rows`
        rows. With the run's tokens-per-step histogram, f is summed over the buckets rather than
        taken at the mean width (f is far from straight: a run of many near-empty and many full
        steps is not one of half-full steps); each bucket's steps sit at the same relative place
        in it, lo + x (hi - lo) rows (at most `max_rows`), x such that the rows add up."""
        if not steps:
            return 0.0
        prefill = self.prefill_token_s * max(0, tokens - rows)
        buckets = [(n, *bucket_bounds(k)) for k, n in (histogram or {}).items()]
        if not buckets or any(hi == float("inf") for _, _, hi in buckets):
            return steps * self.decode_s(rows / steps) + prefill
        cap = float(max_rows or max(hi for *_, hi in buckets))

        def widths(x: float) -> list[tuple[int, float]]:
            return [(n, min(cap, lo + x * (hi - lo))) for n, lo, hi in buckets]

        lo_x, hi_x = 0.0, 1.0
        for _ in range(40):  # bisection: total rows grow with x
            mid = (lo_x + hi_x) / 2
            if sum(n * w for n, w in widths(mid)) < rows:
                lo_x = mid
            else:
                hi_x = mid
        return sum(n * self.decode_s(w) for n, w in widths((lo_x + hi_x) / 2)) + prefill

    def describe(self) -> str:
        points = ", ".join(f"{r:.0f} rows {t * 1e3:.2f} ms" for r, t in self.anchors)
        return (
            f"engine alone ({self.num_steps} in-process steps): decode step {points}; "
            f"+{self.prefill_token_s * 1e6:.1f} us per prefill token"
        )


def compare(run: ModeResult, model: StepModel, at_concurrency: ModeResult, max_rows: int) -> None:
    """Front-end share of `run` against the engine alone on the same steps; rows ratio: what its
    batch shape alone costs, against the in-process run at full concurrency.

    The wall-time share counts every wait of the engine thread, for a core too, so other
    processes on a shared machine inflate it. The CPU bounds do not wait: the engine thread's
    own CPU seconds over HTTP (hand-offs to the event loop, GIL switches) give a low bound, and
    adding the event loop's (as if the GIL serialised all of it with the engine) a high one."""
    alone = model.seconds(
        run.steps, run.tokens_computed, run.tokens_generated, run.tokens_per_step, max_rows
    )
    run.engine_alone_s = alone
    if run.steps:
        run.engine_alone_ms_per_step = alone / run.steps * 1e3
    if run.wall_s > 0:
        run.frontend_share = 1.0 - alone / run.wall_s
    if alone > 0 and at_concurrency.out_tok_s > 0:
        run.rows_ratio = run.tokens_generated / alone / at_concurrency.out_tok_s
    groups = run.server_cpu.get("groups_cpu_s") or {}
    engine, loop = groups.get(ENGINE, 0.0), groups.get(EVENT_LOOP, 0.0)
    if engine > 0:
        run.cpu_share_low = 1.0 - alone / engine
        run.cpu_share_high = 1.0 - alone / (engine + loop)
