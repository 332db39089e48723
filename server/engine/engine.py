"""The engine loop: one model forward per step for every running sequence.

`step()` = drain the inbox (new requests, aborts) -> schedule -> run the model -> choose tokens ->
append, check stop conditions, stream text, retire finished sequences (their blocks return at once).
`submit` and `abort` are thread-safe; the loop runs in its own thread (see async_engine.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from decoding import SamplingTensors, sample_next_tokens
from decoding.stopping import find_stop, holdback
from server.engine.block_pool import BlockPool
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.model_runner import ModelRunner, WorkItem
from server.engine.request import EngineRequest, RequestOutput, SequenceText
from server.engine.scheduler import Scheduler, StepPlan
from server.engine.sequence import Sequence
from server.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    max_seqs_in_step: int = 0
    preemptions: int = 0
    peak_blocks_used: int = 0
    step_seqs_histogram: dict[int, int] = field(default_factory=dict)


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
    ) -> None:
        self.runner = runner
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens)
        capacity = runner.num_blocks * runner.block_size
        self.max_model_len = min(max_model_len or runner.max_position_embeddings, capacity)
        self.eos_token_ids = _eos_ids(runner.model, tokenizer)
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, EngineRequest] = {}
        self._texts: dict[int, SequenceText] = {}

    # ---- thread-safe entry points -------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        self._inbox.put(("add", request))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def wait_for_work(self, timeout: float) -> None:
        if not self.scheduler.has_work() and self._inbox.empty():
            self._wakeup.wait(timeout)
        self._wakeup.clear()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the loop -------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._admit(payload)  # type: ignore[arg-type]
            else:
                self._abort(payload)  # type: ignore[arg-type]

    def _admit(self, req: EngineRequest) -> None:
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(req.params.seed)
        seq = Sequence(req, list(req.prompt_ids), len(req.prompt_ids))
        req.seqs.append(seq)
        self._texts[seq.seq_id] = SequenceText(IncrementalDetokenizer(self.tokenizer, req.prompt_ids))
        self._requests[req.request_id] = req
        self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._retire(seq, text="")

    def step(self) -> bool:
        """Run one engine iteration; False when there was nothing to do."""
        self._drain_inbox()
        plan = self.scheduler.schedule()
        self._record_schedule(plan)
        if not plan.items:
            return False
        self._record_step(plan.items)  # before any output of this step reaches a client
        now = time.monotonic()
        for item in plan.items:
            if item.seq.request.first_scheduled_time is None:
                item.seq.request.first_scheduled_time = now
        try:
            logits = self.runner.execute(plan.items, plan.copies)
            sampling = [i for i in plan.items if i.samples]
            for item in plan.items:
                item.seq.num_computed += item.num_new
            if sampling:
                self._sample_and_append(sampling, logits)
        except Exception as exc:  # a failing step fails its own requests, never the loop
            log.exception("engine step failed")
            self._fail({i.seq.request for i in plan.items}, f"internal error: {type(exc).__name__}: {exc}")
        return True

    def _sample_and_append(self, sampling: list[WorkItem], logits: torch.Tensor) -> None:
        requests = [i.seq.request for i in sampling]
        tensors = SamplingTensors.from_params(
            [r.params for r in requests], logits.shape[-1], logits.device
        )
        tokens = sample_next_tokens(logits, tensors, [r.generator for r in requests]).tolist()
        now = time.monotonic()
        for item, token in zip(sampling, tokens):
            self._record_token_time(item.seq.request, now)
            self._append_token(item.seq, token)
        self.stats.tokens_generated += len(tokens)

    def _append_token(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        text = self._texts[seq.seq_id]
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            seq.finish_reason = "stop"
            self._retire(seq, text=text.detok.flush())
            return
        text.detok.push(token)
        if params.stop:
            full = text.detok.text
            cut = find_stop(full, params.stop, text.stop_checked)
            text.stop_checked = max(0, len(full) - holdback(params.stop))
            if cut is not None:
                seq.finish_reason = "stop"
                self._retire(seq, text=full[text.sent : max(cut, text.sent)])
                return
        if seq.num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            text.detok.flush()
            self._retire(seq, text=text.detok.text[text.sent :])
            return
        ready = len(text.detok.text) - holdback(params.stop)
        if ready > text.sent:
            delta = text.detok.text[text.sent : ready]
            text.sent = ready
            self._emit(seq, delta, [token])
        else:
            self._emit(seq, "", [token])

    def _emit(self, seq: Sequence, text: str, token_ids: list[int], error: str | None = None) -> None:
        req = seq.request
        req.emit(
            RequestOutput(
                request_id=req.request_id,
                index=seq.index,
                text=text,
                token_ids=token_ids,
                finish_reason=seq.finish_reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=seq.num_output,
                error=error,
            )
        )

    def _retire(self, seq: Sequence, text: str, error: str | None = None) -> None:
        """Finish `seq`: free its blocks now, record the request if it is done, send the last delta."""
        self.scheduler.remove(seq)
        self._texts.pop(seq.seq_id, None)
        req = seq.request
        if all(s.finished for s in req.seqs):
            self._requests.pop(req.request_id, None)
            self._record_request_end(req, seq.finish_reason)  # before the client can see the end
        last = seq.token_ids[-1:] if seq.num_output and seq.finish_reason not in ("abort", "error") else []
        self._emit(seq, text, last, error)

    def _fail(self, requests: set[EngineRequest], message: str) -> None:
        for req in requests:
            for seq in req.seqs:
                if not seq.finished:
                    seq.finish_reason = "error"
                    self._retire(seq, text="", error=message)

    def fail_all(self, message: str) -> None:
        """Fail every request in the engine (used when the loop itself must stop)."""
        self._drain_inbox()
        self._fail(set(self._requests.values()), message)

    # ---- statistics and metrics ------------------------------------------------------------------
    def _record_schedule(self, plan: StepPlan) -> None:
        self.stats.preemptions += len(plan.preempted)
        used = self.pool.num_blocks - self.pool.num_free
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        if self.metrics is not None:
            if plan.preempted:
                self.metrics.record_preemptions(len(plan.preempted))
            self.metrics.set_scheduler_state(
                running=self.num_running, waiting=self.num_waiting, kv_cache_usage=self.pool.usage
            )

    def _record_step(self, items: list[WorkItem]) -> None:
        s = self.stats
        num_tokens = sum(i.num_new for i in items)
        s.steps += 1
        s.tokens_computed += num_tokens
        s.max_seqs_in_step = max(s.max_seqs_in_step, len(items))
        s.step_seqs_histogram[len(items)] = s.step_seqs_histogram.get(len(items), 0) + 1
        if self.metrics is not None:
            self.metrics.observe_step(num_tokens=num_tokens, batch_size=len(items))

    def _record_token_time(self, req: EngineRequest, now: float) -> None:
        if self.metrics is not None:
            if req.first_token_time is None:
                self.metrics.record_first_token(now - req.arrival_time)
            else:
                self.metrics.record_inter_token(now - req.last_token_time)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now

    def _record_request_end(self, req: EngineRequest, reason: str | None) -> None:
        now = time.monotonic()
        strategy = req.params.strategy
        prompt_tokens = len(req.prompt_ids)
        generated = sum(s.num_output for s in req.seqs)
        queue_s = (req.first_scheduled_time or now) - req.arrival_time
        e2e_s = now - req.arrival_time
        log.info(
            "request %s finished: %s", req.request_id, reason,
            extra={
                "request_id": req.trace_id or req.request_id, "engine_request_id": req.request_id,
                "finish_reason": reason, "strategy": strategy, "prompt_tokens": prompt_tokens,
                "generation_tokens": generated, "queue_s": round(queue_s, 4),
                "ttft_s": round(req.first_token_time - req.arrival_time, 4) if req.first_token_time else None,
                "e2e_s": round(e2e_s, 4),
            },
        )
        if self.metrics is None:
            return
        if reason in ("stop", "length"):
            self.metrics.record_request_success(
                strategy=strategy,
                finished_reason=reason,
                prompt_tokens=prompt_tokens,
                generation_tokens=generated,
                queue_time_s=queue_s,
                e2e_s=e2e_s,
            )
        else:
            self.metrics.record_request_failure(
                reason="aborted" if reason == "abort" else "internal",
                strategy=strategy,
                prompt_tokens=prompt_tokens,
                generation_tokens=generated,
            )


def _eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
