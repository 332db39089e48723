"""LM fusion in the engine: companion models run beside the main model in every step.

A request with `lm_fusion` names a companion (an extra model served as one). Each step, after
the main model's forward, every companion runs the same plan restricted to the rows of the
requests fused with it (`plan_rows`): their new tokens, their block tables. The companion's KV
pool has as many blocks as the main model's and a fused row's keys and values sit at the same
block ids in both, so whatever the scheduler does to a row's blocks (beams and `n` forked from
the prompt, copy-on-write, preemption, freeing) holds for its companion's cache too, and the
KV memory budget is shared by configuration (server/runner_setup.py). Prefix-cache blocks of a
fused request are shared only with requests fused with the same companion (prefix_cache.py):
another request never wrote the companion's half of them.

The rows' sampled logits are then replaced by the fused scores (decoding/fusion.py), which every
strategy reads. Fused rows take no drafts and are never left in flight (speculation.py,
in_flight.py): the companion's logits are needed before a token is chosen.

An extra model may also draft for speculation (draft_model.py): it follows every step here,
before any companion runs, and makes the step's block copies in its pool itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from itertools import accumulate
from typing import Protocol, cast

import torch

from decoding.fusion import LMFusion, fuse_logits_
from decoding.transfer import to_device
from server.engine.request import EngineRequest
from server.engine.work import Drafter, WorkItem
from server.model.runner import ModelRunner
from server.step_plan import StepOutput, StepPlan, TableEdit


def plan_rows(plan: StepPlan, rows: list[int]) -> StepPlan:
    """The part of `plan` that runs `rows` (indices into its rows) for a model that runs those
    alone: their columns, tokens, table edits and source lengths, every release and block copy;
    nothing scored or encoded, no adapters (fused rows are never deferred)."""
    if plan.deferred is not None and set(plan.deferred.rows) & set(rows):
        raise RuntimeError("a fused row's input token was left on the device")
    index = {r: i for i, r in enumerate(rows)}
    starts = plan.token_starts()
    return StepPlan(
        row_ids=[plan.row_ids[r] for r in rows],
        starts=[plan.starts[r] for r in rows],
        num_new=[plan.num_new[r] for r in rows],
        num_drafts=[plan.num_drafts[r] for r in rows],
        samples=[plan.samples[r] for r in rows],
        tokens=[t for r in rows for t in plan.tokens[starts[r] : starts[r] + plan.num_new[r]]],
        table_edits=[
            TableEdit(index[e.row], e.keep, e.blocks) for e in plan.table_edits if e.row in index
        ],
        released=plan.released,
        copies=plan.copies,
        source_lens=None if plan.source_lens is None else [plan.source_lens[r] for r in rows],
        # a request's rows are all fused or none: its first row is among `rows`
        source_groups=[index[plan.source_groups[r]] for r in rows] if plan.source_groups else [],
    )


class DraftFollower(Drafter, Protocol):
    """An extra model that drafts (draft_model.py): it follows every step's prompts."""

    name: str

    def follow(self, plan: StepPlan, items: list[WorkItem]) -> None: ...


class Companions:
    """The companion models by name, and what a step runs through them."""

    def __init__(
        self,
        runners: Mapping[str, ModelRunner],
        vocab_size: int = 0,
        draft: DraftFollower | None = None,
    ) -> None:
        self.runners = dict(runners)
        self.vocab_size = vocab_size  # the main model's scores per token (0: not checked)
        self.draft = draft  # the extra model that drafts for speculation, if one does

    def refusal(self, request: EngineRequest) -> str | None:
        """Why `request` cannot run here (its companion is not loaded, or scores another
        vocabulary), or None."""
        fusion = request.params.lm_fusion
        if fusion is None:
            return None
        runner = self.runners.get(fusion.model)
        if runner is None:
            return f"lm_fusion: model {fusion.model!r} is not loaded on this server"
        if self.vocab_size and runner.vocab_size != self.vocab_size:
            return (
                f"lm_fusion: model {fusion.model!r} scores {runner.vocab_size} tokens and the "
                f"served model {self.vocab_size}"
            )
        return None

    def fuse(self, plan: StepPlan, items: list[WorkItem], output: StepOutput) -> StepOutput:
        """Run each companion on its fused rows of `plan` (the rows of `items`) and return
        `output` with those rows' logits fused; releases reach every companion. A draft model
        follows the step first (draft_model.py)."""
        if not self.runners:  # no extra models (most servers): no row is looked at, any step
            return output
        if self.draft is not None:  # first: it makes the step's block copies in its pool
            self.draft.follow(plan, items)
        return self._fuse(plan, items, output)

    @torch.inference_mode()  # the logits are inference tensors: fused in place
    def _fuse(self, plan: StepPlan, items: list[WorkItem], output: StepOutput) -> StepOutput:
        fused: dict[str, list[int]] = {}
        for r, item in enumerate(items):
            if (fusion := item.seq.request.params.lm_fusion) is not None:
                fused.setdefault(fusion.model, []).append(r)
        for name, runner in self.runners.items():
            if name not in fused and plan.released:  # forgotten now, as the main model does
                runner.rows.apply(StepPlan(released=plan.released))
        if not fused:
            return output
        logits_rows = [0, *accumulate((1 + d) * s for d, s in zip(plan.num_drafts, plan.samples))]
        rows: list[int] = []  # the fused rows' logits rows, companion by companion
        fusions: list[LMFusion] = []
        parts: list[torch.Tensor] = []
        for name, indices in fused.items():
            part = plan_rows(plan, indices)
            if self.draft is not None and name == self.draft.name:  # copies made: not twice
                part.copies = []
            parts.append(self.runners[name].execute(part).logits)
            for r in indices:
                if plan.samples[r]:
                    rows.append(logits_rows[r])
                    fusions.append(cast(LMFusion, items[r].seq.request.params.lm_fusion))
        if not rows:  # prefill chunks alone: the companions' caches were filled
            return output
        device = output.logits.device
        weights = to_device([f.weight for f in fusions], device, torch.float32).unsqueeze(1)
        alphas = [f.plausibility for f in fusions]
        floor = to_device(alphas, device, torch.float32).unsqueeze(1) if any(alphas) else None
        logits = output.logits.clone() if output.reused else output.logits  # a graph's buffer
        fuse_logits_(logits, to_device(rows, device, torch.long), torch.cat(parts), weights, floor)
        return dataclasses.replace(output, logits=logits, reused=False)
