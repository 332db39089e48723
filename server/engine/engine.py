"""The engine loop: one model forward per step for every running row of every request.

`step()` = drain the inbox (new requests, aborts) -> schedule -> run the model -> commit the step
(scheduler) -> choose tokens (decoding/) -> append them or advance the beam searches -> stream text
(output processor) -> retire what finished (its blocks return at once). `submit` and `abort` are
thread-safe; the loop runs in its own thread (async_engine.py).

A request has one row (greedy, sampling), `n` / `best_of` rows (forked from the prefilled prompt
at its first sample, sharing its blocks), or `num_beams` rows re-forked from their parents at
every step (shared blocks, copy-on-write of the last partial one): no step copies a history.

A chosen token is committed at once (the next step needs it); its text is rendered (detokenized,
searched for stop strings, streamed) either at once or, with `overlap_outputs`, during the next
step, after its forward was queued: on a GPU the text work then runs while the device computes.
Outputs are the same; a row a stop string ends has one more token computed, which is dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from decoding import BeamStep
from decoding.constraints import NO_LEGAL_TOKEN
from server.engine import beams
from server.engine.block_pool import BlockPool
from server.engine.inbox import Inbox
from server.engine.output_processor import OutputProcessor
from server.engine.prefix_cache import PrefixCache
from server.engine.prompt_scoring import PromptScoring
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.engine.sampling_step import without_retired
from server.engine.scheduler import Scheduler
from server.engine.speculation import RowOutcome, Speculator, VerifyBatch
from server.engine.stats import EngineStats, StatsRecorder
from server.metrics import Metrics
from server.model.runner import ModelRunner
from server.work import WorkItem

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        metrics: Metrics | None = None,
        enable_prefix_caching: bool = True,
        overlap_outputs: bool = False,
        speculative_tokens: int = 0,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        self.prefix_cache = PrefixCache(self.pool) if enable_prefix_caching else None
        capacity = runner.num_blocks * runner.block_size
        self.max_model_len = min(max_model_len or runner.max_position_embeddings, capacity)
        drafts = Speculator(speculative_tokens, self.max_model_len).propose  # n-gram; 0: off
        self.scheduler = Scheduler(
            self.pool, max_num_seqs, max_num_batched_tokens, self.prefix_cache,
            propose=drafts if speculative_tokens > 0 else None,
        )  # fmt: skip
        self.eos_token_ids = runner.eos_token_ids(tokenizer)
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.recorder = StatsRecorder(self.pool, None)
        if metrics is not None:
            self.use_metrics(metrics)
        self._inbox = Inbox()
        self._requests: dict[str, EngineRequest] = {}
        self.prompt_scoring = PromptScoring()
        self.overlap_outputs = overlap_outputs  # see the module's docstring
        # called once outputs were emitted (after a render, at a step's end): AsyncEngine hands
        # them to the event loop in one batch then
        self.flush_outputs: Callable[[], None] = lambda: None

    def use_metrics(self, metrics: Metrics) -> None:
        """Record into `metrics` from now on (and publish the KV pool's shape there)."""
        self.recorder.use_metrics(metrics, prefix_caching=self.prefix_cache is not None)

    @property
    def stats(self) -> EngineStats:
        return self.recorder.stats

    # ---- thread-safe entry points ---------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        self._inbox.put_request(request)

    def abort(self, request_id: str) -> None:
        self._inbox.put_abort(request_id)

    def wait_for_work(self, timeout: float) -> None:
        if not self.scheduler.has_work():
            self._inbox.wait(timeout)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats_snapshot(self) -> dict[str, int | float | bool]:
        caching = self.prefix_cache is not None
        return self.recorder.snapshot(self.num_running, self.num_waiting, prefix_caching=caching)

    # ---- admission and abort --------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        for item in self._inbox.drain():
            if isinstance(item, EngineRequest):
                item.prepare(self.eos_token_ids, self.runner.device, self.max_model_len)
                self.prompt_scoring.admit(item)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
            elif (req := self._requests.get(item)) is not None:
                self._end_request(req, "abort")

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one engine iteration; False when there was nothing to do."""
        try:
            return self.recorder.timed(self._step)
        finally:
            self.flush_outputs()

    def _step(self) -> bool:
        self._drain_inbox()
        plan = self.scheduler.schedule()
        self.recorder.schedule(len(plan.preempted), plan.cache_queries, plan.cache_hits)
        self._record_state()
        if not plan.items:
            return self._render_outputs()  # the last step's text, if it waits for a next step
        self.recorder.step(plan.items)  # before any output of this step reaches a client
        try:
            plan.items = self.prompt_scoring.plan(plan.items)
            output = self.runner.execute(plan.items, plan.copies)
            # Overlap: on a GPU the forward above is only queued; the previous step's text is
            # rendered while it runs (before any read of this step's results).
            self._render_outputs()
            self.prompt_scoring.record(plan.items, output.scores)
            sampling = self.scheduler.update_from_output(plan)
            if sampling:
                self._decode(sampling, output.logits)
            if not self.overlap_outputs:
                self._render_outputs()
        except Exception as exc:  # a failing step fails its own requests, never the loop
            log.exception("engine step failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            for req in {item.seq.request for item in plan.items} | self.output.drop_pending():
                self._end_request(req, "error", message)
        return True

    def _render_outputs(self) -> bool:
        """Stream the text of the tokens committed since the last call and end the rows a stop
        string ended; False when there was nothing to render."""
        if not self.output.has_pending:
            return False
        for seq, reason in self.output.render_pending():
            self._finish_row(seq, reason)
        if self.overlap_outputs:  # while the device computes: the clients get this text now
            self.flush_outputs()  # (else step() flushes once the step's time is counted)
        return True

    # ---- choosing tokens ------------------------------------------------------------------------
    def _decode(self, sampling: list[WorkItem[Sequence]], logits: torch.Tensor) -> None:
        """Choose next tokens for every sampled row, then apply them request by request (a
        request's rows are adjacent: the scheduler plans by request)."""
        if self.prompt_scoring.prompt_only:  # max_tokens 0: the prompt is computed, that was all
            sampling, logits, done = self.prompt_scoring.split_prompt_only(sampling, logits)
            for seq in done:
                self._finish_row(seq, "length", appended=False)
            if not sampling:
                return
        if self.overlap_outputs:  # rows a stop string ended while this step ran: token dropped
            sampling, logits = without_retired(sampling, logits)
            if not sampling:
                return
        rows, index = self.scheduler.fork_first_samples([item.seq for item in sampling])
        batch = VerifyBatch(sampling, rows, index)  # one position per logits row (speculation)
        choices, logits = batch.choose(logits, self.eos_token_ids)
        if choices.mask_seconds is not None:
            self.recorder.constraint_mask(choices.mask_seconds)
        beam_reqs: list[tuple[EngineRequest, slice]] = []
        now = time.monotonic()
        start = 0
        while start < len(rows):
            req = rows[start].request
            span = slice(start, start + len(req.rows))
            if req.search is not None:
                beam_reqs.append((req, batch.span(span)))
            else:
                outcomes = [batch.outcome(r, choices) for r in range(span.start, span.stop)]
                self.recorder.tokens(req, sum(len(o.tokens) for o in outcomes), now)
                for seq, outcome in zip(rows[span], outcomes):
                    self._apply(seq, outcome)
            start = span.stop
        if beam_reqs:
            reqs = [req for req, _ in beam_reqs]
            spans = [span for _, span in beam_reqs]
            steps = beams.step_searches(reqs, choices.scores, logits, spans)
            for req, beam_step in zip(reqs, steps):
                self.recorder.tokens(req, 0 if beam_step.done else len(beam_step.tokens), now)
                self._apply_beam_step(req, beam_step)

    # ---- rows that sample on their own: greedy, sampling, n, best_of ----------------------------
    def _apply(self, seq: Sequence, outcome: RowOutcome) -> None:
        """Append the row's kept tokens (accepted drafts + the token chosen after) until one ends
        it; a constrained row left without a legal token ends after them."""
        for token, logprob in zip(outcome.tokens, outcome.logprobs):
            self._append(seq, token, logprob)
            if seq.retired:
                break
        if outcome.drafted:
            self.scheduler.accept_drafts(seq, outcome.accepted)
            self.recorder.drafts(outcome.drafted, outcome.accepted)
        if outcome.no_token and not seq.retired:  # a complete output stops, else it says so
            done = seq.constraint is not None and seq.constraint.accepting
            self._finish_row(seq, "stop" if done else NO_LEGAL_TOKEN, appended=False)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        constraint = seq.constraint
        if constraint is not None and token not in seq.request.finishing_ids:
            if not constraint.advance(token):  # the mask allowed it: a limit hit mid-way
                log.warning(
                    "request %s: constraint failed on token %d", seq.request.request_id, token
                )
                self._finish_row(seq, NO_LEGAL_TOKEN, appended=False)
                return
        if self.output.commit(seq, token, logprob) is not None:
            self._retire(seq)  # out of the next step at once; its ending is told when rendered

    def _retire(self, seq: Sequence) -> None:
        """The row leaves the batch: no further step computes it, its blocks are free."""
        seq.retired = True
        seq.request.rows.remove(seq)
        seq.request.done_rows.append(seq)
        self.scheduler.release_row(seq)

    def _finish_row(self, seq: Sequence, reason: str, appended: bool = True) -> None:
        """The row's ending is known: tell it (the request's last output once no row of it is
        running or waiting for its text)."""
        req = seq.request
        if not seq.retired:
            self._retire(seq)
        seq.finish_reason = reason
        if req.rows or any(row.finish_reason is None for row in req.done_rows):
            self.output.finish_row(seq, reason, request_done=False, appended=appended)
            return
        self._close_request(req, reason)  # metrics first: never behind what clients see
        if req.streams:
            self.output.finish_row(seq, reason, request_done=True, appended=appended)
        else:  # best_of: every sample is in; return the n most likely
            self.output.emit_best_samples(req)

    # ---- beams ----------------------------------------------------------------------------------
    def _apply_beam_step(self, req: EngineRequest, beam_step: BeamStep) -> None:
        if beams.advance(req, beam_step, self.scheduler.fork_beams, self.max_model_len):
            hypotheses = beams.search_of(req).finalize()
            self._close_request(req, hypotheses[0].finish_reason if hypotheses else "length")
            self.output.emit_choices(req, beams.choices(req, hypotheses))

    # ---- endings --------------------------------------------------------------------------------
    def _close_request(self, req: EngineRequest, reason: str) -> None:
        """The request is over: free every block it still holds and record it (before the client
        sees its last output, so metrics are never behind the responses)."""
        req.finished = True
        self.prompt_scoring.discard(req)
        self.scheduler.remove(req)
        self._requests.pop(req.request_id, None)
        self.recorder.request_end(req, reason)
        self._record_state()

    def _end_request(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        """Abort or fail a request that has not finished: one last output ends its stream."""
        if req.finished:
            return
        self._close_request(req, reason)
        self.output.emit_end(req, reason, error)

    def _record_state(self) -> None:
        self.recorder.state(self.num_running, self.num_waiting)

    def fail_all(self, message: str) -> None:
        """Fail every request in the engine (used when the loop itself must stop)."""
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._end_request(req, "error", message)
