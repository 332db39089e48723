"""A step's chosen tokens applied to its rows: appended until one ends the row (a finishing id,
a length limit, a grammar with no legal token), drafts kept or given back, beam searches
advanced (their rows re-forked) and finished ones answered."""

from __future__ import annotations

import logging
import time

import torch

from decoding import BeamStep
from decoding.constraints import NO_LEGAL_TOKEN
from server.engine import beams
from server.engine.endings import Endings
from server.engine.output_processor import OutputProcessor
from server.engine.request import EngineRequest, Sequence, TokenLogprob
from server.engine.sampling_step import Choices
from server.engine.scheduler import Scheduler
from server.engine.speculation import RowOutcome, VerifyBatch
from server.engine.stats import StatsRecorder

log = logging.getLogger(__name__)


class ChoiceApplier:
    def __init__(
        self,
        scheduler: Scheduler,
        output: OutputProcessor,
        recorder: StatsRecorder,
        endings: Endings,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.output = output
        self.recorder = recorder
        self.endings = endings
        self.max_model_len = max_model_len

    def apply(self, batch: VerifyBatch, choices: Choices, logits: torch.Tensor) -> None:
        """Apply the choices request by request (a request's rows are adjacent: the scheduler
        plans by request); `logits`: the positions' raw logits (beam searches read them)."""
        rows = batch.rows
        if choices.mask_seconds is not None:
            self.recorder.constraint_mask(choices.mask_seconds)
        beam_reqs: list[tuple[EngineRequest, slice]] = []
        now = time.monotonic()
        start = 0
        while start < len(rows):
            req = rows[start].request
            if req.finished:  # ended while its tokens were in flight: nothing to apply
                start += 1
                continue
            if len(req.rows) == 1 and req.search is None and not batch.drafts[start]:
                at = batch.starts[start]  # its position (rows before it may have drafted)
                if at not in choices.no_token:  # one row, one token: no outcome to work out
                    self.recorder.tokens(req, 1, now)
                    self._append(rows[start], choices.tokens[at], choices.logprobs.get(at))
                else:
                    self._apply_row(rows[start], batch.outcome(start, choices))
                start += 1
                continue
            span = slice(start, start + len(req.rows))
            if req.search is not None:
                beam_reqs.append((req, batch.span(span)))
            else:
                outcomes = [batch.outcome(r, choices) for r in range(span.start, span.stop)]
                self.recorder.tokens(req, sum(len(o.tokens) for o in outcomes), now)
                for seq, outcome in zip(rows[span], outcomes):
                    self._apply_row(seq, outcome)
            start = span.stop
        if beam_reqs:
            reqs = [req for req, _ in beam_reqs]
            spans = [span for _, span in beam_reqs]
            steps = beams.step_searches(reqs, choices.scores, logits, spans)
            for req, beam_step in zip(reqs, steps):
                self.recorder.tokens(req, 0 if beam_step.done else len(beam_step.tokens), now)
                self._apply_beam_step(req, beam_step)

    # ---- rows that sample on their own: greedy, sampling, n, best_of ----------------------------
    def _apply_row(self, seq: Sequence, outcome: RowOutcome) -> None:
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
            self.endings.finish_row(seq, "stop" if done else NO_LEGAL_TOKEN, appended=False)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        constraint = seq.constraint
        if constraint is not None and token not in seq.request.finishing_ids:
            if not constraint.advance(token):  # the mask allowed it: a limit hit mid-way
                log.warning(
                    "request %s: constraint failed on token %d", seq.request.request_id, token
                )
                self.endings.finish_row(seq, NO_LEGAL_TOKEN, appended=False)
                return
        if self.output.commit(seq, token, logprob) is not None:  # out of the next step at once;
            self.endings.retire(seq)  # its ending is told when its text is rendered

    # ---- beams ----------------------------------------------------------------------------------
    def _apply_beam_step(self, req: EngineRequest, beam_step: BeamStep) -> None:
        if beams.advance(req, beam_step, self.scheduler.fork_beams, self.max_model_len):
            hypotheses = beams.search_of(req).finalize()
            self.endings.close_request(req, hypotheses[0].finish_reason if hypotheses else "length")
            self.output.emit_choices(req, beams.choices(req, hypotheses))
