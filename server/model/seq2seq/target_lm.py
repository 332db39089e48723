"""A decoder-only language model that runs an encoder-decoder model's rows: LM fusion's companion
of a translation or summarization model (engine/fusion.py), fairseq's target-side LM.

It runs the same plan as the encoder-decoder model, on the same block ids: each row's decoder
tokens only (`decoder_part`), from position 0 for its own position embeddings, attending over
the row's decoder positions alone (the source's positions of its pool hold nothing). So it reads
what `generate()` feeds the decoder: the decoder's start token, then the output so far.
"""

from __future__ import annotations

import torch

from server.model.paged_step import PagedStep
from server.model.runner import ModelRunner
from server.model.seq2seq.runner import decoder_part, decoder_positions
from server.model.step_context import DecodeStep, StepContext
from server.step_plan import StepOutput, StepPlan


class TargetLM(ModelRunner):
    def _run_decoder(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        ctx: StepContext | DecodeStep | PagedStep,
    ) -> torch.Tensor:
        return super()._run_decoder(input_ids, decoder_positions(position_ids, ctx), ctx)

    def _execute(self, plan: StepPlan, tables: list[list[int]]) -> StepOutput:
        """The plan's decoder tokens, packed (never the decoder-only decode path: its rows'
        attention would start at position 0, in the source's positions)."""
        sources = plan.source_lens or [0] * len(plan)
        part, kept = decoder_part(plan, sources)
        if not kept:  # every row's tokens were source positions (a chunked source)
            return StepOutput(torch.empty((0, self.vocab_size), device=self.device))
        return self._execute_packed(part, [tables[r] for r in kept])
