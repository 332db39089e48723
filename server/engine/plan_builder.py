"""A step's scheduled items turned into the plain `StepPlan` the model side reads (step_plan.py).

Each row remembers the block table the model side holds for it (`Sequence.model_table`), so a
plan carries a whole table only for a row the model side has not seen and otherwise the entries
that changed. Those can only be at or past the row's first uncomputed block: the scheduler writes
(grows, copies on write) only where the row's next tokens go, and trims only the blocks of
rejected drafts, so the comparison starts there and costs a block or two per row.
"""

from __future__ import annotations

from server.engine.work import WorkItem
from server.step_plan import (
    AdapterInstall,
    DeferredTokens,
    PlanScore,
    SourceEncode,
    StepPlan,
    TableEdit,
)


class PlanBuilder:
    def __init__(self, block_size: int, lora: bool, sources: bool = False) -> None:
        self.block_size = block_size
        self.lora = lora  # plans carry each row's adapter slot
        self.sources = sources  # an encoder-decoder model: plans carry each row's source
        self.installs: list[AdapterInstall] = []  # for the next plan (before its forward)

    def build(
        self,
        items: list[WorkItem],
        copies: list[tuple[int, int]],
        released: list[int],
        deferred: DeferredTokens | None = None,
    ) -> StepPlan:
        """The plan of a step of `items` (in packing order), after `copies`; the model side
        forgets the `released` rows first."""
        plan = StepPlan(copies=copies, released=released, deferred=deferred)
        row_ids, starts, num_new = plan.row_ids, plan.starts, plan.num_new
        num_drafts, samples, tokens = plan.num_drafts, plan.samples, plan.tokens
        bs = self.block_size
        ranked: int | None = 0  # None once a sampling row reads every token
        logits_rows = 0  # the step's logits rows before this item's (1 + drafts per sampling row)
        for r, item in enumerate(items):
            seq, start, n, draft = item.seq, item.seq.num_computed, item.num_new, item.draft
            row_ids.append(seq.seq_id)
            starts.append(start)
            num_new.append(n)
            num_drafts.append(len(draft))
            samples.append(item.samples)
            if item.samples:
                if seq.request.returns_logprobs:  # computed exactly
                    plan.exact_logits += range(logits_rows, logits_rows + 1 + len(draft))
                logits_rows += 1 + len(draft)
                need = seq.request.ranked_tokens
                ranked = None if ranked is None or not need else max(ranked, need)
            if n == 1:
                tokens.append(seq.token_ids[start])
            else:
                tokens += seq.token_ids[start : start + n - len(draft)]
                tokens += draft
            if item.score is not None:
                span = item.score
                targets = seq.token_ids[span.start + 1 : span.stop + 1]
                plan.scores.append(PlanScore(r, span.start, span.stop, span.num_top, targets))
            if start < seq.prompt_len and seq.request.scores_prompt:  # a prefill chunk first
                plan.exact.append(r)
            table, sent = seq.block_table, seq.model_table
            if sent is None:
                plan.table_edits.append(TableEdit(r, 0, list(table)))
                seq.model_table = list(table)
                continue
            same = min(len(sent), len(table))
            keep = min(same, start // bs)
            while keep < same and sent[keep] == table[keep]:
                keep += 1
            if keep < len(sent) or keep < len(table):
                plan.table_edits.append(TableEdit(r, keep, table[keep:]))
                del sent[keep:]
                sent += table[keep:]
        if self.lora:
            plan.lora_slots = [item.seq.lora_slot for item in items]
        if self.sources:
            plan.source_lens = [item.seq.request.source_len for item in items]
            first_rows: dict[int, int] = {}
            plan.source_groups = [
                first_rows.setdefault(id(item.seq.request), r) for r, item in enumerate(items)
            ]
            plan.encodes = [
                SourceEncode(r, item.seq.token_ids[:source], item.seq.request.source_features)
                for r, (item, source) in enumerate(zip(items, plan.source_lens))
                if item.seq.num_computed < source
            ]
            plan.aligns = [
                r
                for r, (item, source) in enumerate(zip(items, plan.source_lens))
                if item.seq.request.params.cross_attention
                and item.seq.num_computed + item.num_new > source
            ]
        plan.ranked = ranked or 0
        plan.installs, self.installs = self.installs, []
        return plan
