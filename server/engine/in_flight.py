"""Async scheduling: a step's chosen tokens stay on the device while the next step is planned and
queued, and are read back (and applied) only once that next forward is on its way.

After a step chooses its tokens on the device, every row that goes on holds a placeholder in
place of its new token, so the scheduler plans its next step as usual (one pending token, its
KV slot reserved); the runner takes those input tokens from the device (`DeferredTokens`). Once
that forward is queued, `land` reads the tokens (their copy to the host was started right after
they were chosen, so the read waits for that step only), swaps the placeholders for them, and the
engine applies them as it always did: appends, endings, text. On a GPU the host's work for step
N+1 (scheduling, inputs, reading, committing, rendering, building the sampling tensors) then runs
while the device computes step N.

What a token decides after it was read costs one row of one step, which is dropped: a row that a
finishing token, a stop string or its grammar ends has one more token computed. A row that its
length limit ends gets no placeholder (that is known without the token). A step overlaps only
when its next step does not depend on the tokens' values: not with beam searches (the search picks
the next rows) nor with drafts (looked up from the last token); those steps read at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.request import Sequence
from server.engine.sampling_step import Choices, PendingChoices
from server.engine.speculation import VerifyBatch
from server.engine.work import WorkItem
from server.step_plan import DeferredTokens

PLACEHOLDER = 0  # a valid id, so any host code that reads a row early reads a token


@dataclass(eq=False)
class InFlight:
    """A step whose tokens were chosen on the device and are not read back yet."""

    batch: VerifyBatch
    pending: PendingChoices
    placeholders: dict[Sequence, int]  # row -> its position in the step's chosen tokens

    @classmethod
    def start(cls, batch: VerifyBatch, pending: PendingChoices, max_model_len: int) -> InFlight:
        """Start reading the tokens back, and put placeholders in the rows that go on."""
        pending.start_reads()
        placeholders: dict[Sequence, int] = {}
        for r, seq in enumerate(batch.rows):
            params = seq.request.params
            if seq.num_output + 1 < params.max_tokens and len(seq.token_ids) + 1 < max_model_len:
                seq.token_ids.append(PLACEHOLDER)
                placeholders[seq] = r
        return cls(batch, pending, placeholders)

    @staticmethod
    def can_overlap(batch: VerifyBatch) -> bool:
        """Whether the next step can be planned without this step's token values."""
        return not any(batch.drafts) and all(
            s.request.search is None and s.request.params.lm_fusion is None for s in batch.rows
        )  # a fused row's next step needs its token to run its companion

    def inputs(self, items: list[WorkItem]) -> DeferredTokens | None:
        """Where the next step's items take their first token from this step's tokens."""
        at, sources = [], []
        for i, item in enumerate(items):
            r = self.placeholders.get(item.seq)
            if r is not None:
                assert item.seq.num_computed == len(item.seq.token_ids) - 1, "placeholder not next"
                at.append(i)
                sources.append(r)
        tokens = self.pending.drawn.tokens
        return DeferredTokens(tokens, at, sources) if at and tokens is not None else None

    def land(self) -> Choices:
        """The tokens read back, the placeholders taken out (the engine appends the tokens)."""
        self.drop()
        return self.pending.read()

    def drop(self) -> None:
        """Take the placeholders out without reading (a failed step, a stopping engine)."""
        for seq in self.placeholders:
            seq.token_ids.pop()
        self.placeholders = {}
