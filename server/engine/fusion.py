"""Extra models in the engine: they answer the requests that name them, and run beside the main
model in every step as companions (LM fusion) and drafters.

A request whose `model` names an extra model runs its rows on it (`Companions.serves`): each step
that holds rows of several models runs each model on its part of the plan (server/plan_split.py)
and merges their logits back in the step's order, so choosing reads one batch. Such a model must
read text as the main model does (loading.serving_refusals): one tokenizer, one set of ids that
end a sequence, one set of sampling tensors serve every row.

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
before any model runs, and makes the step's block copies in its pool itself. Every pool gets a
step's copies once, whichever of drafting, serving and fusing runs in it first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol, cast

import torch

from decoding.fusion import LMFusion, fuse_logits_
from decoding.transfer import to_device
from server.engine.request import EngineRequest
from server.engine.work import Drafter, WorkItem
from server.model.runner import ModelRunner
from server.plan_split import logits_starts, merge_outputs, subset_plan
from server.step_plan import StepOutput, StepPlan


def plan_rows(plan: StepPlan, rows: list[int]) -> StepPlan:
    """The part of `plan` that runs `rows` (indices into its rows) for a companion that runs
    them beside the model that serves them: their columns, tokens, table edits and sources,
    every release and block copy; nothing scored or encoded, no adapters (fused rows are never
    deferred)."""
    if plan.deferred is not None and set(plan.deferred.rows) & set(rows):
        raise RuntimeError("a fused row's input token was left on the device")
    part = subset_plan(plan, rows)[0]
    part.scores, part.exact, part.exact_logits, part.encodes, part.aligns = [], [], [], [], []
    part.lora_slots, part.installs, part.ranked = None, [], 0
    return part


class DraftFollower(Drafter, Protocol):
    """An extra model that drafts (draft_model.py): it follows every step's prompts."""

    name: str

    def follow(self, plan: StepPlan, items: list[WorkItem]) -> None: ...


class Companions:
    """The extra models by name, and what a step runs through them: the rows of requests that
    name one, and the companions of fused rows."""

    def __init__(
        self,
        runners: Mapping[str, ModelRunner],
        vocab_size: int = 0,
        draft: DraftFollower | None = None,
        served: Mapping[str, str | None] | None = None,
    ) -> None:
        self.runners = dict(runners)
        self.vocab_size = vocab_size  # the main model's scores per token (0: not checked)
        self.draft = draft  # the extra model that drafts for speculation, if one does
        # the extra models a request's `model` may name: None, or why it cannot (serving_refusals)
        self.served = dict(served or {})

    def serves(self, request: EngineRequest) -> bool:
        """Whether the model `request` names is an extra model; it then runs the request's rows."""
        if request.model_name not in self.runners:
            return False
        request.model = request.model_name
        return True

    def refusal(self, request: EngineRequest) -> str | None:
        """Why `request` cannot run here (it names an extra model that cannot serve it, its
        companion is not loaded, is the model serving it or scores another vocabulary), or None."""
        if request.model is not None:
            why = self.served.get(request.model, "it is loaded to fuse and draft only")
            if why is not None:
                return f"model {request.model!r} cannot serve requests on this server: {why}"
        fusion = request.params.lm_fusion
        if fusion is None:
            return None
        runner = self.runners.get(fusion.model)
        if runner is None:
            return f"lm_fusion: model {fusion.model!r} is not loaded on this server"
        if fusion.model == request.model:
            return f"lm_fusion: model {fusion.model!r} serves this request: it is not fused twice"
        if self.vocab_size and runner.vocab_size != self.vocab_size:
            return (
                f"lm_fusion: model {fusion.model!r} scores {runner.vocab_size} tokens and the "
                f"served model {self.vocab_size}"
            )
        return None

    def run(self, main: ModelRunner, plan: StepPlan, items: list[WorkItem]) -> StepOutput:
        """Run the step `plan` of `items`: each row on the model its request names (`main`
        unless an extra model), then each fused row's companion, whose log-probs are fused into
        its logits. A draft model follows the step first (draft_model.py). Each model's pool
        gets the step's block copies once, and its releases."""
        if not self.runners:  # no extra models (most servers): no row is looked at, any step
            return main.execute(plan)
        for runner in self.runners.values():  # a step compiled beside serving: from this step
            runner.decode_step.between_steps()
        ran: set[str] = set()  # the extra models that made the step's copies and releases
        if self.draft is not None:  # first: it makes the step's block copies in its pool
            self.draft.follow(plan, items)
            ran.add(self.draft.name)
        return self._fuse(plan, items, self._serve(main, plan, items, ran), ran)

    def _serve(
        self, main: ModelRunner, plan: StepPlan, items: list[WorkItem], ran: set[str]
    ) -> StepOutput:
        main_rows: list[int] = []
        by_model: dict[str, list[int]] = {}
        for r, item in enumerate(items):
            name = item.seq.request.model
            (main_rows if name is None else by_model.setdefault(name, [])).append(r)
        if not by_model:  # the served model's rows alone: the plan as it is
            return main.execute(plan)
        part, logits_rows = subset_plan(plan, main_rows)  # its installs, even with no rows
        parts = [(main_rows, logits_rows, main.execute(part))]
        for name, rows in by_model.items():
            part, logits_rows = subset_plan(plan, rows)
            part.lora_slots, part.installs = None, []  # adapters are the served model's
            if name in ran:
                part.copies = []
            ran.add(name)
            parts.append((rows, logits_rows, self.runners[name].execute(part)))
        return merge_outputs(logits_starts(plan)[-1], parts)

    @torch.inference_mode()  # the logits are inference tensors: fused in place
    def _fuse(
        self, plan: StepPlan, items: list[WorkItem], output: StepOutput, ran: set[str]
    ) -> StepOutput:
        fused: dict[str, list[int]] = {}
        for r, item in enumerate(items):
            if (fusion := item.seq.request.params.lm_fusion) is not None:
                fused.setdefault(fusion.model, []).append(r)
        for name, runner in self.runners.items():
            if name not in fused and name not in ran and plan.released:  # forgotten now
                runner.rows.apply(StepPlan(released=plan.released))
        if not fused:
            return output
        first_logits = logits_starts(plan)
        rows: list[int] = []  # the fused rows' logits rows, companion by companion
        fusions: list[LMFusion] = []
        parts: list[torch.Tensor] = []
        for name, indices in fused.items():
            part = plan_rows(plan, indices)
            if name in ran:  # copies made: not twice
                part.copies = []
            ran.add(name)
            parts.append(self.runners[name].execute(part).logits)
            for r in indices:
                if plan.samples[r]:
                    rows.append(first_logits[r])
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
