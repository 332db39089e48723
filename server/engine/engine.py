"""The engine loop: one model forward per step for every running row of every request.

`step()` = drain the inbox (new requests, aborts) -> schedule -> run the model -> decode (decoding/)
-> append tokens, fork beams, check stop conditions, stream text, retire what finished (its blocks
return at once). `submit` and `abort` are thread-safe; the loop runs in its own thread.

A request has one row (greedy, sampling), `n` / `best_of` rows (forked from the prefilled prompt,
sharing its blocks), or `num_beams` rows whose KV blocks are forked from their parent row at every
step (shared blocks, copy-on-write of the last partial one): no step copies a whole history.
With prefix caching on, every block a step fills is tagged with its prefix hash, and a new request
starts from the cached blocks of its prompt's longest known prefix (prefix_cache.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from decoding import (
    BeamSearch,
    SamplingTensors,
    choose_tokens,
    make_beam_search,
    process_logits,
    rank_samples,
    step_beam_searches,
    token_logprobs,
)
from decoding.beam_search import BeamStep, Hypothesis
from decoding.stopping import find_stop, holdback
from server.engine.block_pool import BlockPool
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.prefix_cache import PrefixCache
from server.engine.request import EngineRequest, RequestOutput, Sequence, SequenceText, TokenLogprob
from server.engine.scheduler import Scheduler, StepPlan
from server.metrics import Metrics
from server.model.runner import ModelRunner
from server.work import WorkItem

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    max_seqs_in_step: int = 0
    preemptions: int = 0
    peak_blocks_used: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted rows looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from cached blocks
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
        enable_prefix_caching: bool = True,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        self.prefix_cache = PrefixCache(self.pool) if enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.pool, max_num_seqs, max_num_batched_tokens, self.prefix_cache
        )
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

    def stats_snapshot(self) -> dict[str, int | float | bool]:
        s, pool = self.stats, self.pool
        return {
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free,
            "peak_kv_blocks_used": s.peak_blocks_used,
            "steps": s.steps,
            "tokens_computed": s.tokens_computed,
            "tokens_generated": s.tokens_generated,
            "max_seqs_in_step": s.max_seqs_in_step,
            "preemptions": s.preemptions,
            "prefix_caching": self.prefix_cache is not None,
            "kv_blocks_cached": pool.num_cached,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hits / max(1, s.prefix_cache_queries),
        }

    # ---- admission and abort ----------------------------------------------------------------------
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
        params = req.params
        req.finishing_ids = params.finishing_ids(self.eos_token_ids)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if params.is_beam:
            room = self.max_model_len - len(req.prompt_ids)
            req.search = make_beam_search(params, self.eos_token_ids, max_new_tokens=room)
            if params.logprobs is not None:
                req.beam_logprobs = {}
        req.rows.append(self._new_row(req, list(req.prompt_ids), index=0))
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def _new_row(self, req: EngineRequest, token_ids: list[int], index: int) -> Sequence:
        seq = Sequence(req, token_ids, len(req.prompt_ids), index=index)
        if req.streams:
            self._texts[seq.seq_id] = SequenceText(
                IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
            )
        return seq

    def _abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._end_request(req, "abort")

    # ---- the step ---------------------------------------------------------------------------------
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
            req = item.seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.cached_tokens = min(item.seq.num_computed, len(req.prompt_ids))
        try:
            logits = self.runner.execute(plan.items, plan.copies)
            sampling = [i for i in plan.items if i.samples]
            cache = self.prefix_cache
            for item in plan.items:
                item.seq.num_computed += item.num_new
                if cache is not None:
                    cache.register(item.seq, item.seq.num_computed - item.num_new)
            if sampling:
                self._decode(sampling, logits)
        except Exception as exc:  # a failing step fails its own requests, never the loop
            log.exception("engine step failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            for req in {i.seq.request for i in plan.items}:
                self._end_request(req, "error", message)
        return True

    def _decode(self, sampling: list[WorkItem], logits: torch.Tensor) -> None:
        """Choose next tokens for every sampled row, then apply them request by request."""
        rows = [item.seq for item in sampling]
        rows, logits = self._expand_first_samples(rows, logits)
        params = [s.request.params for s in rows]
        tensors = SamplingTensors.from_rows(
            params,
            [s.request.prompt_ids for s in rows],
            [s.output_ids for s in rows],
            self.eos_token_ids,
            logits.shape[-1],
            logits.device,
        )
        scores = process_logits(logits, tensors)
        tokens = choose_tokens(scores, tensors, [s.request.generator for s in rows]).tolist()
        logprobs = self._token_logprobs(rows, logits, tokens, tensors.logprob_rows)

        beam_reqs: list[EngineRequest] = []
        beam_scores: list[torch.Tensor] = []
        start = 0
        now = time.monotonic()
        while start < len(rows):
            req = rows[start].request
            count = len(req.rows)
            self._record_token_time(req, now)
            if req.search is not None:
                beam_reqs.append(req)
                beam_scores.append(scores[start : start + count])
                if req.beam_logprobs is not None:
                    self._remember_beam_logprobs(
                        req, logits[start : start + count], beam_scores[-1]
                    )
            else:
                for r in range(start, start + count):
                    self._append_token(rows[r], tokens[r], logprobs.get(r))
            start += count
        if beam_reqs:
            for req, beam_step in zip(beam_reqs, self._step_searches(beam_reqs, beam_scores)):
                self._apply_beam_step(req, beam_step)

    def _expand_first_samples(
        self, rows: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[Sequence], torch.Tensor]:
        """A request with n / best_of > 1 prefills its prompt once, as one row; at its first sample
        that row forks into its width, the children sharing the prompt's blocks."""
        if all(s.request.search is not None or s.request.width == 1 or s.num_output for s in rows):
            return rows, logits
        out_rows: list[Sequence] = []
        index: list[int] = []
        for r, seq in enumerate(rows):
            req = seq.request
            if req.search is not None or req.width == 1 or seq.num_output or len(req.rows) > 1:
                out_rows.append(seq)
                index.append(r)
                continue
            for k in range(1, req.width):
                child = self._new_row(req, list(seq.token_ids), index=k)
                child.num_computed = seq.num_computed
                child.block_table = self.pool.share(seq.block_table)
                child.block_hashes = list(seq.block_hashes)
                req.rows.append(child)
            out_rows.extend(req.rows)
            index.extend([r] * req.width)
        return out_rows, logits.index_select(0, torch.tensor(index, device=logits.device))

    def _token_logprobs(
        self, rows: list[Sequence], logits: torch.Tensor, tokens: list[int], wanted: list[int]
    ) -> dict[int, TokenLogprob]:
        if not wanted:  # `logprob_rows` lists non-beam rows only: beams keep their own (below)
            return {}
        top = max(rows[r].request.params.logprobs or 0 for r in wanted)
        lp = token_logprobs(logits, [tokens[r] for r in wanted], rows=wanted, num_top=top)
        out = {}
        for i, r in enumerate(wanted):
            chosen, alternatives = lp.row(i, rows[r].request.params.logprobs or 0)
            out[r] = TokenLogprob(tokens[r], chosen, alternatives)
        return out

    # ---- independent rows: greedy, sampling, n, best_of -------------------------------------------
    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        req = seq.request
        params = req.params
        seq.token_ids.append(token)
        req.generated_tokens += 1
        self.stats.tokens_generated += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.logprobs.append(logprob)
        finishing = token in req.finishing_ids
        text = self._texts.get(seq.seq_id)
        if text is not None and not finishing:
            text.detok.push(token)
        if finishing:
            self._finish_row(seq, "stop")
        elif text is not None and params.stop and self._hit_stop_string(text, params.stop):
            self._finish_row(seq, "stop")
        elif seq.num_output >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish_row(seq, "length")
        elif text is not None:
            ready = len(text.detok.text) - holdback(params.stop)
            delta = ""
            if ready > text.sent:
                delta, text.sent = text.detok.text[text.sent : ready], ready
            self._emit(
                req, seq.index, delta, [token], None, seq.num_output, seq.logprobs[-1:] or None
            )

    @staticmethod
    def _hit_stop_string(text: SequenceText, stops: tuple[str, ...]) -> bool:
        """True (and the text cut before it) once a stop string appears in the generated text."""
        cut = find_stop(text.detok.text, stops, text.stop_checked)
        text.stop_checked = max(0, len(text.detok.text) - holdback(stops))
        if cut is None:
            return False
        text.detok.text = text.detok.text[:cut]
        text.cut = True
        return True

    def _finish_row(self, seq: Sequence, reason: str) -> None:
        req = seq.request
        seq.finish_reason = reason
        req.rows.remove(seq)
        req.done_rows.append(seq)
        self.scheduler.release_row(seq)
        if req.streams:
            text = self._texts.pop(seq.seq_id)
            if not text.cut:
                text.detok.flush()
            last = not req.rows
            if last:
                self._close_request(req, reason)
            self._emit(
                req,
                seq.index,
                text.detok.text[text.sent :],
                seq.token_ids[-1:],
                reason,
                seq.num_output,
                seq.logprobs[-1:] or None,
                request_done=last,
            )
        elif not req.rows:  # best_of: every sample is in; return the n most likely
            self._close_request(req, reason)
            ranked = rank_samples([s.cumulative_logprob for s in req.done_rows], req.params.n)
            chosen = [req.done_rows[i] for i in ranked]
            self._emit_final(
                req,
                [(s.output_ids, s.finish_reason or "length", s.logprobs or None) for s in chosen],
            )

    # ---- beams ------------------------------------------------------------------------------------------
    def _remember_beam_logprobs(
        self, req: EngineRequest, logits: torch.Tensor, scores: torch.Tensor
    ) -> None:
        """Keep the raw logprob of every token a beam may append this step (which path wins is
        known only at the end), keyed by the generated tokens it would complete."""
        k = req.params.logprobs or 0
        logp = logits.float().log_softmax(dim=-1)
        top = logp.topk(k, dim=-1) if k else None
        width = min(2 * len(req.rows) + len(req.finishing_ids) + 1, scores.shape[-1])
        likely = scores.topk(width, dim=-1).indices.tolist()  # the beam picks by processed scores
        for r, seq in enumerate(req.rows):
            prefix = tuple(seq.output_ids)
            alternatives = list(zip(top.indices[r].tolist(), top.values[r].tolist())) if top else []
            for token in {*likely[r], *req.finishing_ids}:
                req.beam_logprobs[(*prefix, token)] = TokenLogprob(
                    token, float(logp[r, token]), alternatives
                )  # type: ignore[index]

    def _beam_path_logprobs(
        self, req: EngineRequest, token_ids: list[int]
    ) -> list[TokenLogprob] | None:
        entries = [req.beam_logprobs.get(tuple(token_ids[: i + 1])) for i in range(len(token_ids))]  # type: ignore[union-attr]
        return None if any(e is None for e in entries) else entries  # type: ignore[return-value]

    @staticmethod
    def _step_searches(reqs: list[EngineRequest], scores: list[torch.Tensor]) -> list[BeamStep]:
        """Plain beam searches share one batched top-k; group beam searches step on their own."""
        plain = [i for i, r in enumerate(reqs) if isinstance(r.search, BeamSearch)]
        steps: list[BeamStep | None] = [None] * len(reqs)
        batched = step_beam_searches([reqs[i].search for i in plain], [scores[i] for i in plain])
        for i, beam_step in zip(plain, batched):
            steps[i] = beam_step
        for i, req in enumerate(reqs):
            if steps[i] is None:
                steps[i] = req.search.step(scores[i])  # type: ignore[union-attr]
        return steps  # type: ignore[return-value]

    def _apply_beam_step(self, req: EngineRequest, beam_step: BeamStep) -> None:
        if beam_step.done:
            self._finish_beams(req)
            return
        children = []
        for parent_index, token in zip(beam_step.parents, beam_step.tokens):
            parent = req.rows[parent_index]
            child = Sequence(
                req, [*parent.token_ids, token], parent.prompt_len, index=len(children)
            )
            child.num_computed = parent.num_computed
            child.block_table = self.pool.share(parent.block_table)
            child.block_hashes = list(parent.block_hashes)
            children.append(child)
        for parent in req.rows:
            self.scheduler.release_row(parent)
        req.rows[:] = children
        req.generated_tokens += len(children)
        self.stats.tokens_generated += len(children)
        if children and len(children[0].token_ids) >= self.max_model_len:
            self._finish_beams(req)

    def _finish_beams(self, req: EngineRequest) -> None:
        hypotheses: list[Hypothesis] = req.search.finalize()  # type: ignore[union-attr]
        self._close_request(req, hypotheses[0].finish_reason if hypotheses else "length")
        self._emit_final(
            req,
            [
                (
                    h.token_ids,
                    h.finish_reason,
                    self._beam_path_logprobs(req, h.token_ids)
                    if req.beam_logprobs is not None
                    else None,
                )
                for h in hypotheses
            ],
        )

    # ---- outputs and endings ------------------------------------------------------------------------
    def _emit_final(
        self, req: EngineRequest, choices: list[tuple[list[int], str, list | None]]
    ) -> None:
        """Send whole choices at once (beams, best_of), applying stop strings to each."""
        for index, (token_ids, reason, logprobs) in enumerate(choices):
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            cut = find_stop(text, req.params.stop) if req.params.stop else None
            if cut is not None:
                text, reason = text[:cut], "stop"
            elif token_ids and token_ids[-1] in req.finishing_ids:
                reason = "stop"
            self._emit(
                req,
                index,
                text,
                list(token_ids),
                reason,
                len(token_ids),
                logprobs,
                request_done=index == len(choices) - 1,
            )

    def _emit(
        self,
        req: EngineRequest,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        completion_tokens: int,
        logprobs: list[TokenLogprob] | None = None,
        error: str | None = None,
        request_done: bool = False,
    ) -> None:
        req.emit(
            RequestOutput(
                request_id=req.request_id,
                index=index,
                text=text,
                token_ids=token_ids,
                finish_reason=finish_reason,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                completion_tokens=completion_tokens,
                logprobs=logprobs,
                error=error,
                request_done=request_done,
            )
        )

    def _close_request(self, req: EngineRequest, reason: str) -> None:
        """The request is over: free every block it still holds and record it (before the client
        sees its last output, so metrics are never behind the responses)."""
        req.finished = True
        self.scheduler.remove(req)
        for seq in req.done_rows:
            self._texts.pop(seq.seq_id, None)
        self._requests.pop(req.request_id, None)
        self._record_request_end(req, reason)
        self._record_state()

    def _end_request(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        """Abort or fail a request that has not finished: one last output ends its stream."""
        if req.finished:
            return
        for seq in req.rows:
            self._texts.pop(seq.seq_id, None)
        self._close_request(req, reason)
        self._emit(req, 0, "", [], reason, 0, error=error, request_done=True)

    def fail_all(self, message: str) -> None:
        """Fail every request in the engine (used when the loop itself must stop)."""
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._end_request(req, "error", message)

    # ---- statistics and metrics ----------------------------------------------------------------------
    def _record_schedule(self, plan: StepPlan) -> None:
        self.stats.preemptions += len(plan.preempted)
        if plan.cache_queries:
            self.stats.prefix_cache_queries += plan.cache_queries
            self.stats.prefix_cache_hits += plan.cache_hits
            if self.metrics is not None:
                self.metrics.record_prefix_cache(queries=plan.cache_queries, hits=plan.cache_hits)
        used = self.pool.num_blocks - self.pool.num_free
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        if self.metrics is not None and plan.preempted:
            self.metrics.record_preemptions(len(plan.preempted))
        self._record_state()

    def _record_state(self) -> None:
        if self.metrics is not None:
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
        generated = req.generated_tokens
        queue_s = (req.first_scheduled_time or now) - req.arrival_time
        e2e_s = now - req.arrival_time
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
                "ttft_s": round(req.first_token_time - req.arrival_time, 4)
                if req.first_token_time
                else None,
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
