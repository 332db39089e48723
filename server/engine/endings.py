"""How rows and requests end: a row leaves the batch at once (its blocks are free), its ending is
told once its text is out, and a request closes when its last row has ended: every block it
still holds is returned and it is recorded before the client sees its last output."""

from __future__ import annotations

from server.engine.output_processor import OutputProcessor
from server.engine.prompt_scoring import PromptScoring
from server.engine.request import EngineRequest, Sequence
from server.engine.scheduler import Scheduler
from server.engine.stats import StatsRecorder


class Endings:
    def __init__(
        self,
        scheduler: Scheduler,
        output: OutputProcessor,
        recorder: StatsRecorder,
        prompt_scoring: PromptScoring,
        requests: dict[str, EngineRequest],
    ) -> None:
        self.scheduler = scheduler
        self.output = output
        self.recorder = recorder
        self.prompt_scoring = prompt_scoring
        self.requests = requests  # the engine's open requests, by id

    def retire(self, seq: Sequence) -> None:
        """The row leaves the batch: no further step computes it, its blocks are free."""
        seq.retired = True
        seq.request.rows.remove(seq)
        seq.request.done_rows.append(seq)
        self.scheduler.release_row(seq)
        seq.release_penalties()

    def finish_row(self, seq: Sequence, reason: str, appended: bool = True) -> None:
        """The row's ending is known: tell it (the request's last output once no row of it is
        running or waiting for its text)."""
        req = seq.request
        if not seq.retired:
            self.retire(seq)
        seq.finish_reason = reason
        if req.rows or any(row.finish_reason is None for row in req.done_rows):
            self.output.finish_row(seq, reason, request_done=False, appended=appended)
            return
        self.close_request(req, reason)  # metrics first: never behind what clients see
        if req.streams:
            self.output.finish_row(seq, reason, request_done=True, appended=appended)
        else:  # best_of: every sample is in; return the n most likely
            self.output.emit_best_samples(req)

    def close_request(self, req: EngineRequest, reason: str) -> None:
        """The request is over: free every block it still holds and record it (before the client
        sees its last output, so metrics are never behind the responses)."""
        req.finished = True
        self.prompt_scoring.discard(req)
        for seq in req.rows:
            seq.release_penalties()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.recorder.request_end(req, reason)
        self.record_state()

    def end_request(self, req: EngineRequest, reason: str, error: str | None = None) -> None:
        """Abort or fail a request that has not finished: one last output ends its stream."""
        if req.finished:
            return
        self.close_request(req, reason)
        self.output.emit_end(req, reason, error)

    def record_state(self) -> None:
        self.recorder.state(len(self.scheduler.running), len(self.scheduler.waiting))
