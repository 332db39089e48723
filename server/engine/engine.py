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
With `async_scheduling` the tokens themselves are read back only once the next step's forward is
queued (in_flight.py): the host plans, builds and commits while the device computes. Applying
tokens (applying.py) and ending rows and requests (endings.py) have modules of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from decoding.penalty_table import PenaltyTable
from decoding.row_tensors import KeptRowTensors
from server.engine.applying import ChoiceApplier
from server.engine.block_pool import BlockPool
from server.engine.client import UnknownAdapter
from server.engine.endings import Endings
from server.engine.fusion import Companions
from server.engine.in_flight import InFlight
from server.engine.inbox import Inbox, UnloadAdapter
from server.engine.lora_service import EngineLoRA
from server.engine.output_processor import OutputProcessor
from server.engine.plan_builder import PlanBuilder
from server.engine.prefix_cache import PrefixCache
from server.engine.prompt_scoring import PromptScoring
from server.engine.request import EngineRequest
from server.engine.sampling_step import without_retired
from server.engine.scheduler import Scheduler
from server.engine.speculation import Speculator, VerifyBatch
from server.engine.stats import EngineStats, StatsRecorder
from server.engine.work import WorkItem
from server.metrics import Metrics
from server.model.runner import ModelRunner, eos_token_ids
from server.step_plan import StepPlan

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
        async_scheduling: bool = False,
        max_cpu_loras: int | None = None,
        companions: Companions | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.pool = BlockPool(runner.num_blocks, runner.block_size)
        self.prefix_cache = PrefixCache(self.pool) if enable_prefix_caching else None
        capacity = runner.num_blocks * runner.block_size
        self.max_model_len = min(max_model_len or runner.max_position_embeddings, capacity)
        drafts = Speculator(speculative_tokens, self.max_model_len)  # n-gram; 0: off
        # LoRA adapters (runner.lora: the model's slots): served names, slots, installs
        self.lora = EngineLoRA(runner.lora, max_cpu_loras) if runner.lora is not None else None
        self.companions = companions or Companions({})  # extra models: fused, drafting
        self.scheduler = Scheduler(
            self.pool, max_num_seqs, max_num_batched_tokens, self.prefix_cache,
            drafter=self.companions.draft or (drafts if speculative_tokens > 0 else None),
            adapters=self.lora.slots if self.lora else None,
        )  # fmt: skip
        self.plans = PlanBuilder(
            runner.block_size, lora=self.lora is not None, sources=runner.encoder_decoder
        )
        self.kept_rows = KeptRowTensors()  # sampling tensors of the rows' params, step to step
        self.penalty_table = PenaltyTable(runner.device)  # penalized rows' tokens, step to step
        self.eos_token_ids = eos_token_ids(runner.model, tokenizer)
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.recorder = StatsRecorder(self.pool, None)
        if metrics is not None:
            self.use_metrics(metrics)
        self._inbox = Inbox()
        self._requests: dict[str, EngineRequest] = {}
        self.prompt_scoring = PromptScoring()
        self.endings = Endings(
            self.scheduler, self.output, self.recorder, self.prompt_scoring, self._requests
        )
        self.applier = ChoiceApplier(
            self.scheduler, self.output, self.recorder, self.endings, self.max_model_len
        )
        self.overlap_outputs = overlap_outputs  # see the module's docstring
        self.async_scheduling = async_scheduling  # see in_flight.py
        self._in_flight: InFlight | None = None
        # called once outputs were emitted (after a render, at a step's end): AsyncEngine hands
        # them to the event loop in one batch then
        self.flush_outputs: Callable[[], None] = lambda: None

    def use_metrics(self, metrics: Metrics) -> None:
        """Record into `metrics` from now on (and publish the KV pool's shape there)."""
        compiled = self.runner.decode_step.state == "compiled"
        self.recorder.use_metrics(metrics, self.prefix_cache is not None, compiled)

    @property
    def stats(self) -> EngineStats:
        return self.recorder.stats

    # ---- thread-safe entry points ---------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        self._inbox.put_request(request)

    def abort(self, request_id: str) -> None:
        self._inbox.put_abort(request_id)

    def load_adapter(self, name: str, source: str) -> None:
        """Serve the LoRA adapter at `source` as `name` (any thread; reads and checks its files:
        lora.files.AdapterError, or ValueError when the name is taken or LoRA is off)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this server (max_loras is 0)")
        self.lora.registry.add(name, source)
        log.info("LoRA adapter %s loaded from %s", name, source)

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (UnknownAdapter if not served); requests submitted before this
        call still run with it."""
        if self.lora is None:
            raise UnknownAdapter(name)
        self._inbox.put_unload(self.lora.registry.remove(name))
        log.info("LoRA adapter %s unloaded", name)

    def adapter_names(self) -> dict[str, str]:
        """Served adapter names and their sources."""
        return self.lora.registry.names() if self.lora is not None else {}

    def wait_for_work(self, timeout: float) -> None:
        if not self.scheduler.has_work():
            self._inbox.wait(timeout)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats_snapshot(self) -> dict[str, int | float | bool | str]:
        caching, step = self.prefix_cache is not None, self.runner.decode_step.state
        return self.recorder.snapshot(self.num_running, self.num_waiting, caching, step)

    # ---- admission and abort --------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        for item in self._inbox.drain():
            if isinstance(item, UnloadAdapter):
                if self.lora is not None:
                    self.lora.registry.forget(item.key)
            elif isinstance(item, EngineRequest):
                if (refusal := self._refusal(item)) is not None:
                    self.output.emit_end(item, "error", refusal)
                    continue
                item.prepare(self.eos_token_ids, self.runner.device, self.max_model_len)
                self.prompt_scoring.admit(item)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
            elif (req := self._requests.get(item)) is not None:
                self._land()  # its tokens in flight first: a row ends with what it has
                self.endings.end_request(req, "abort")

    def _refusal(self, request: EngineRequest) -> str | None:
        """Why `request` cannot run here (the model it names or fuses cannot serve it), or None."""
        if (name := request.model_name) is None or self.companions.serves(request):
            return self.companions.refusal(request)
        if self.lora is None:
            return f"LoRA adapter {name!r} is not loaded"
        return self.lora.resolve(request, self.recorder.metrics) or self.companions.refusal(request)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one engine iteration; False when there was nothing to do."""
        if self.runner.decode_step.between_steps():  # compiled beside serving: from this step
            self.recorder.compiled_step_in_use()
        try:
            return self.recorder.timed(self._step)
        finally:
            self.flush_outputs()

    def _step(self) -> bool:
        self._drain_inbox()
        schedule = self.scheduler.schedule(speculate=self._in_flight is None)
        if self.lora is not None:  # the adapters given a slot go in before the next forward
            self.plans.installs += self.lora.take_installs(
                self.scheduler.waiting, self.recorder.metrics
            )
        self.recorder.schedule(len(schedule.preempted), schedule.cache_queries, schedule.cache_hits)
        self.endings.record_state()
        if not schedule.items:  # the last step's tokens and text, if they wait for a next step
            landed = self._in_flight is not None
            self._land()
            return self._render_outputs() or landed
        self.recorder.step(schedule.items)  # before any output of this step reaches a client
        plan: StepPlan | None = None
        try:
            schedule.items = self.prompt_scoring.plan(schedule.items)
            deferred = self._in_flight.inputs(schedule.items) if self._in_flight else None
            released = self.scheduler.take_released()
            plan = self.plans.build(schedule.items, schedule.copies, released, deferred)
            output = self.companions.run(self.runner, plan, schedule.items)
            # Overlap: on a GPU the forward above is only queued; the previous step's tokens are
            # read and applied, and its text rendered, while it runs.
            if self._land() and deferred is not None:
                return True  # a top-k tie changed a token this step read: it runs again
            self._render_outputs()
            self.prompt_scoring.record(schedule.items, output.scores, output.cross_attention)
            sampling = self.scheduler.update_from_output(schedule)
            if sampling:
                self._decode(sampling, output.logits, output.reused)
            if not self.overlap_outputs:
                self._render_outputs()
        except Exception as exc:  # a failing step fails its own requests, never the loop
            log.exception("engine step failed")
            message = f"internal error: {type(exc).__name__}: {exc}"
            failed = {item.seq.request for item in schedule.items} | self.output.drop_pending()
            if plan is not None:  # its adapters may not be in their slots: the next plan's are
                self.plans.installs[:0] = plan.installs
            if self._in_flight is not None:
                failed |= {seq.request for seq in self._in_flight.batch.rows}
                self._in_flight.drop()
                self._in_flight = None
            for req in failed:
                self.endings.end_request(req, "error", message)
        return True

    def _render_outputs(self) -> bool:
        """Stream the text of the tokens committed since the last call and end the rows a stop
        string ended; False when there was nothing to render."""
        if not self.output.has_pending:
            return False
        for seq, reason in self.output.render_pending():
            self.endings.finish_row(seq, reason)
        if self.overlap_outputs:  # while the device computes: the clients get this text now
            self.flush_outputs()  # (else step() flushes once the step's time is counted)
        return True

    # ---- choosing tokens ------------------------------------------------------------------------
    def _decode(self, sampling: list[WorkItem], logits: torch.Tensor, reused: bool = False) -> None:
        """Choose next tokens for every sampled row, then apply them request by request (a
        request's rows are adjacent: the scheduler plans by request). `reused`: the next step
        overwrites `logits` (a CUDA graph's output)."""
        if self.prompt_scoring.prompt_only:  # max_tokens 0: the prompt is computed, that was all
            sampling, logits, done = self.prompt_scoring.split_prompt_only(sampling, logits)
            for seq in done:
                self.endings.finish_row(seq, "length", appended=False)
            if not sampling:
                return
        if self.overlap_outputs or self.async_scheduling:  # rows that ended while this step
            # ran (a stop string, a finishing token read late): their token is dropped
            sampling, logits = without_retired(sampling, logits)
            if not sampling:
                return
        rows, index = self.scheduler.fork_first_samples([item.seq for item in sampling])
        batch = VerifyBatch(sampling, rows, index)  # one position per logits row (speculation)
        pending, logits = batch.choose(
            logits, self.eos_token_ids, self.kept_rows, self.penalty_table
        )
        if self.async_scheduling and InFlight.can_overlap(batch):  # read once the next is queued
            if reused:
                pending.keep_logits()
            self._in_flight = InFlight.start(batch, pending, self.max_model_len)
            return
        self.applier.apply(batch, pending.read(), logits)

    def _land(self) -> bool:
        """Read back and apply the tokens of the step in flight, if any (async scheduling);
        True when a top-k tie changed a token from the one the device chose."""
        flight = self._in_flight
        if flight is None:
            return False
        choices = flight.land()
        self.applier.apply(flight.batch, choices, flight.pending.logits)
        self._in_flight = None  # only now: a step that fails here fails its requests (_step)
        return choices.refined

    def fail_all(self, message: str) -> None:
        """Fail every request in the engine (used when the loop itself must stop)."""
        if self._in_flight is not None:
            self._in_flight.drop()
            self._in_flight = None
        self._drain_inbox()
        for req in list(self._requests.values()):
            self.endings.end_request(req, "error", message)
