"""Counters of the engine (for /v1/engine/stats and tests) and the Prometheus metrics it feeds.

One small object records every event of a step in both places, so the engine loop only says what
happened. Request ends are logged here too, with the figures the metrics get.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from server.engine.block_pool import BlockPool
from server.engine.request import EngineRequest
from server.engine.work import WorkItem
from server.metrics import FINISHED_REASONS, Metrics

Number = int | float | bool | str  # str: the decode step's state
log = logging.getLogger("server.engine.engine")  # request-end logs keep their historical logger


@dataclass
class EngineStats:
    steps: int = 0
    busy_seconds: float = 0.0  # wall time inside steps that did work (the rest: idle or waiting)
    tokens_computed: int = 0
    tokens_generated: int = 0
    max_seqs_in_step: int = 0
    step_seqs_histogram: dict[int, int] = field(default_factory=dict)  # rows in a step -> steps
    # the KV cache
    preemptions: int = 0
    peak_blocks_used: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted rows looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from cached blocks
    # constrained decoding: steps that built an allowed-token mask, and the time that took
    constraint_mask_steps: int = 0
    constraint_mask_seconds: float = 0.0
    # n-gram speculation: rows that drafted in a step, their draft tokens, the accepted ones
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class StatsRecorder:
    """Writes the engine's events into `EngineStats` and, when enabled, the Prometheus metrics."""

    def __init__(self, pool: BlockPool, metrics: Metrics | None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.stats = EngineStats()

    def use_metrics(self, metrics: Metrics, prefix_caching: bool, compiled: bool) -> None:
        """Record into `metrics` from now on, and publish the KV pool's shape there and whether
        the decode step runs compiled."""
        self.metrics = metrics
        metrics.set_cache_config(
            block_size=self.pool.block_size,
            num_blocks=self.pool.num_blocks,
            prefix_caching=prefix_caching,
        )
        metrics.set_decode_step_compiled(compiled)

    def compiled_step_in_use(self) -> None:
        """The decode step compiled beside serving runs from this step on."""
        if self.metrics is not None:
            self.metrics.set_decode_step_compiled(True)

    def snapshot(
        self, running: int, waiting: int, prefix_caching: bool, decode_step: str
    ) -> dict[str, Number]:
        """Every counter, for GET /v1/engine/stats, and what decode steps run (decode_step.py:
        eager, compiling or compiled)."""
        s, pool = self.stats, self.pool
        return {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free,
            "peak_kv_blocks_used": s.peak_blocks_used,
            "steps": s.steps,
            "busy_seconds": s.busy_seconds,
            "tokens_computed": s.tokens_computed,
            "tokens_generated": s.tokens_generated,
            "max_seqs_in_step": s.max_seqs_in_step,
            "preemptions": s.preemptions,
            "prefix_caching": prefix_caching,
            "kv_blocks_cached": pool.num_cached,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / max(1, s.prefix_cache_queries),
            "constraint_mask_steps": s.constraint_mask_steps,
            "constraint_mask_seconds": s.constraint_mask_seconds,
            "spec_decode_num_drafts": s.spec_drafts,
            "spec_decode_num_draft_tokens": s.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": s.spec_accepted_tokens,
            "decode_step": decode_step,
        }

    def schedule(self, preempted: int, cache_queries: int, cache_hits: int) -> None:
        s = self.stats
        s.preemptions += preempted
        if cache_queries:
            s.prefix_cache_queries += cache_queries
            s.prefix_cache_hits += cache_hits
            if self.metrics is not None:
                self.metrics.record_prefix_cache(queries=cache_queries, hits=cache_hits)
        used = self.pool.num_blocks - self.pool.num_free
        s.peak_blocks_used = max(s.peak_blocks_used, used)
        if self.metrics is not None and preempted:
            self.metrics.record_preemptions(preempted)

    def timed(self, step: Callable[[], bool]) -> bool:
        """Run one engine step; the seconds of a step that did work count as busy (over a run,
        busy / wall time is the share of it the engine computed: what a front end sharing the
        process leaves it, see benchmarks/frontend_cost.py)."""
        start = time.perf_counter()
        busy = step()
        if busy:
            self.stats.busy_seconds += time.perf_counter() - start
        return busy

    def state(self, running: int, waiting: int) -> None:
        if self.metrics is not None:
            self.metrics.set_scheduler_state(
                running=running, waiting=waiting, kv_cache_usage=self.pool.usage
            )

    def step(self, items: list[WorkItem]) -> None:
        """A forward pass over `items` is about to run."""
        now = time.monotonic()
        for item in items:
            req = item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.cached_tokens = min(item.seq.num_computed, len(req.prompt_ids))
        num_tokens, num_rows = sum(i.num_new for i in items), len(items)
        s = self.stats
        s.steps += 1
        s.tokens_computed += num_tokens
        s.max_seqs_in_step = max(s.max_seqs_in_step, num_rows)
        s.step_seqs_histogram[num_rows] = s.step_seqs_histogram.get(num_rows, 0) + 1
        if self.metrics is not None:
            self.metrics.observe_step(num_tokens=num_tokens, batch_size=num_rows)

    def constraint_mask(self, seconds: float) -> None:
        """A step built the allowed-token mask of its constrained rows in `seconds`."""
        self.stats.constraint_mask_steps += 1
        self.stats.constraint_mask_seconds += seconds
        if self.metrics is not None:
            self.metrics.observe_constraint_mask(seconds)

    def tokens(self, req: EngineRequest, count: int, now: float) -> None:
        """`count` tokens of `req` were generated at `now` (one per row that sampled)."""
        req.generated_tokens += count
        self.stats.tokens_generated += count
        if self.metrics is not None:
            if req.first_token_time is None:
                self.metrics.record_first_token(now - req.arrival_time, req.model)
            elif req.last_token_time is not None:
                self.metrics.record_inter_token(now - req.last_token_time, req.model)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now

    def request_end(self, req: EngineRequest, reason: str) -> None:
        now = time.monotonic()
        strategy = req.params.strategy
        prompt_tokens = req.num_prompt_tokens
        generated = req.generated_tokens
        queue_s = (req.first_scheduled_time or now) - req.arrival_time
        e2e_s = now - req.arrival_time
        ttft_s = req.first_token_time - req.arrival_time if req.first_token_time else None
        log.info(
            "request %s finished: %s",
            req.request_id,
            reason,
            extra={
                "request_id": req.trace_id or req.request_id,
                "engine_request_id": req.request_id,
                "finish_reason": reason,
                "strategy": strategy,
                "prompt_tokens": prompt_tokens,
                "generation_tokens": generated,
                "cached_tokens": req.cached_tokens,
                "queue_s": round(queue_s, 4),
                "ttft_s": round(ttft_s, 4) if ttft_s is not None else None,
                "e2e_s": round(e2e_s, 4),
            },
        )
        if self.metrics is None:
            return
        if reason in FINISHED_REASONS:
            self.metrics.record_request_success(
                strategy=strategy,
                finished_reason=reason,
                prompt_tokens=prompt_tokens,
                generation_tokens=generated,
                queue_time_s=queue_s,
                e2e_s=e2e_s,
                model=req.model,
            )
        else:
            self.metrics.record_request_failure(
                reason="aborted" if reason == "abort" else "internal",
                strategy=strategy,
                prompt_tokens=prompt_tokens,
                generation_tokens=generated,
                model=req.model,
            )

    def drafts(self, drafted: int, accepted: int) -> None:
        """A row's `drafted` speculative tokens were verified; `accepted` of them were kept."""
        s = self.stats
        s.spec_drafts += 1
        s.spec_draft_tokens += drafted
        s.spec_accepted_tokens += accepted
        if self.metrics is not None:
            self.metrics.record_spec_decode(drafted=drafted, accepted=accepted)
