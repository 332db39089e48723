"""Speculation with a draft model: a small language model proposes each row's next tokens.

`--speculative-model NAME` names one of the extra models (engine/fusion.py) sharing the served
model's vocabulary. Before a step, every row that may draft (speculation.can_draft) runs through
the draft model a few times, batched over the rows: its first forward catches the draft's cache
up to the row's pending token (one or two tokens: what the last verification kept), each next
one feeds back the token it chose, greedily. The drafts are then verified by the served model in
the step exactly as n-gram drafts are (speculation.VerifyBatch): every position chooses its own
token, the row keeps its drafts up to the first one that differs. A greedy row's output is
therefore unchanged, and a sampled row's too, token for token with the same seed: its i-th token
still draws number i of its random stream, and a draft is kept only where it equals that draw.
That is stronger than distribution preservation; the price is that greedy drafts are accepted
only as often as the sampled token equals the draft model's likeliest.

The draft's KV pool has the served model's block ids (as a fused companion's has), so a row's
draft cache lives in its own blocks: forks, copy-on-write, preemption and freeing hold for it with
no bookkeeping. Prompts reach it as the served model computes them (`follow`: every prefill chunk
of a request that is not fused and names no extra model: it drafts for the served model), so
prefix-cached blocks carry the draft's keys and values too.
`Sequence.draft_computed` counts the tokens the draft holds; a draft cache that is stale anyway
(a prefix-cached block written while decoding a beam) costs acceptance, never output.
"""

from __future__ import annotations

import logging

import torch

from decoding.constraints import TokenConstraint, apply_constraint_mask_, build_constraint_mask
from decoding.speculation import DraftLength, RowDrafts
from server.engine.block_pool import BlockPool
from server.engine.fusion import plan_rows
from server.engine.request import Sequence
from server.engine.speculation import can_draft, draft_room, fitting_drafts
from server.engine.work import WorkItem
from server.model.runner import ModelRunner
from server.step_plan import StepPlan, TableEdit

log = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, name: str, runner: ModelRunner, num_tokens: int, max_model_len: int) -> None:
        self.name = name  # its extra model's name
        self.runner = runner
        self.num_tokens = num_tokens  # most drafts per row per step
        self.max_model_len = max_model_len
        self._copied: list[tuple[int, int]] | None = None  # the step copies made by drafting

    def add(
        self, items: list[WorkItem], budget: int, pool: BlockPool, copies: list[tuple[int, int]]
    ) -> None:
        """Drafts for the items that may take them, within `budget` and the free blocks."""
        rows: list[tuple[Sequence, int]] = []  # (row, most drafts it may take)
        taking: list[WorkItem] = []
        for item in items:
            if budget <= 0:
                break
            if not can_draft(item) or item.seq.request.model is not None:  # another model's
                continue
            seq = item.seq
            state = seq.drafts
            if state is None:
                state = seq.drafts = RowDrafts(DraftLength(self.num_tokens))
            if not state.length.drafts_now():
                continue
            room = draft_room(seq, state.length.length, budget, self.max_model_len)
            room = fitting_drafts(pool, seq, room) if room > 0 else 0
            if room <= 0:
                continue
            pool.grow(seq.block_table, seq.num_computed + 1 + room)  # new blocks: private
            rows.append((seq, room))
            taking.append(item)
            budget -= room
        if not rows:
            return
        try:
            drafts = self._draft(rows, copies)
        except Exception:  # drafts are optional: the step runs without them, nobody fails
            log.exception("the draft model failed; this step runs without drafts")
            self._copied = None
            drafts = [[] for _ in rows]
        for item, draft in zip(taking, drafts):
            pool.shrink(item.seq.block_table, item.seq.num_computed + 1 + len(draft))
            item.draft = draft
            item.num_new += len(draft)

    @torch.inference_mode()
    def _draft(
        self, rows: list[tuple[Sequence, int]], copies: list[tuple[int, int]]
    ) -> list[list[int]]:
        """Each row's drafts: its greedy continuation by the draft model, at most `room` tokens,
        among the tokens its grammar allows."""
        seqs = [seq for seq, _ in rows]
        grammars = DraftGrammars(seqs)
        rooms = [room for _, room in rows]
        starts = [min(seq.draft_computed, seq.num_computed) for seq in seqs]
        first = StepPlan(
            row_ids=[seq.seq_id for seq in seqs],
            starts=starts,
            num_new=[len(seq.token_ids) - start for seq, start in zip(seqs, starts)],
            num_drafts=[0] * len(seqs),
            samples=[True] * len(seqs),
            tokens=[t for seq, start in zip(seqs, starts) for t in seq.token_ids[start:]],
            # the whole table: the draft model's copy may be behind (rows not drafted since)
            table_edits=[TableEdit(r, 0, list(seq.block_table)) for r, seq in enumerate(seqs)],
            copies=copies,
        )
        self._copied = copies  # the step's own list (StepPlan.copies is it): made once
        drafts: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        logits = self.runner.execute(first).logits
        for j in range(max(rooms)):
            if j:
                step = StepPlan(
                    row_ids=[seqs[r].seq_id for r in live],
                    starts=[seqs[r].num_computed + j for r in live],
                    num_new=[1] * len(live),
                    num_drafts=[0] * len(live),
                    samples=[True] * len(live),
                    tokens=[drafts[r][-1] for r in live],
                )
                logits = self.runner.execute(step).logits
            for r, token in zip(live, grammars.choose(logits, live)):
                if token is None:  # its grammar allows nothing the draft model scores
                    rooms[r] = len(drafts[r])
                    continue
                drafts[r].append(token)
                if token in seqs[r].request.finishing_ids:  # the row would end there
                    rooms[r] = len(drafts[r])
            live = [r for r in live if rooms[r] > j + 1]
            if not live:
                break
        grammars.keep_states()
        for seq, draft in zip(seqs, drafts):  # its pending token and all drafts but the last
            seq.draft_computed = seq.num_computed + len(draft)
        return drafts

    @torch.inference_mode()
    def follow(self, plan: StepPlan, items: list[WorkItem]) -> None:
        """In the step of `plan` (of `items`), before any model runs it: the draft model computes
        the step's prefill chunks of the served model's rows too, and forgets the released
        rows; the step's block copies are made in its pool here unless drafting made them
        already (made once, before anything writes to the copies: before its model serves or
        fuses rows)."""
        copies = [] if plan.copies is self._copied else plan.copies
        self._copied = None
        deferred = set(plan.deferred.rows) if plan.deferred is not None else set()
        rows = [
            r
            for r, item in enumerate(items)
            if not item.draft
            and (item.num_new > 1 or item.seq.num_computed < item.seq.prompt_len)
            and item.seq.request.params.lm_fusion is None
            and item.seq.request.model is None
            and r not in deferred
        ]
        if not rows:
            self.runner.rows.apply(StepPlan(released=plan.released))
            self.runner.kv_cache.copy_blocks(copies)
            return
        chunk = plan_rows(plan, rows)
        chunk.samples = [False] * len(rows)  # nothing to choose: its cache is filled
        chunk.num_drafts = [0] * len(rows)
        chunk.copies = copies
        # whole tables: the draft model saw this row's last edits only if it ran it then
        chunk.table_edits = [
            TableEdit(i, 0, list(items[r].seq.block_table)) for i, r in enumerate(rows)
        ]
        try:
            self.runner.execute(chunk)
        except Exception:  # its rows catch up when they draft (from what the draft holds)
            log.exception("the draft model failed to follow this step's prompts")
            return
        for r in rows:
            seq: Sequence = items[r].seq
            seq.draft_computed = seq.num_computed + items[r].num_new


class DraftGrammars:
    """The drafting rows' grammar states (constrained rows, rows with `allowed_token_ids`): the
    draft model chooses its likeliest allowed token; each drafted token advances a fork of the
    state, which verification reads (RowDrafts.constraints)."""

    def __init__(self, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self.masked = any(
            seq.constraint is not None or seq.request.params.allowed_token_ids for seq in seqs
        )
        self.states: list[TokenConstraint | None] = [seq.constraint for seq in seqs]
        self.kept: list[list[TokenConstraint]] = [[] for _ in seqs]

    def choose(self, logits: torch.Tensor, rows: list[int]) -> list[int | None]:
        """The token each of `rows` (its logits row, in order) drafts next; None: none allowed."""
        if not self.masked:
            return logits.argmax(-1).tolist()
        seqs = [self.seqs[r] for r in rows]
        mask = build_constraint_mask(
            [self.states[r] for r in rows],
            [seq.request.finishing_ids for seq in seqs],
            (),
            logits.shape[-1],
            logits.device,
            [seq.request.params.allowed_token_ids for seq in seqs],
        )
        if mask is not None:
            logits = logits.clone()
            apply_constraint_mask_(logits, mask)
        best = logits.max(-1)
        chosen: list[int | None] = []
        for r, token, score in zip(rows, best.indices.tolist(), best.values.tolist()):
            state = self.states[r]
            if score == float("-inf"):
                chosen.append(None)
            elif state is None or token in self.seqs[r].request.finishing_ids:
                chosen.append(token)
            else:
                state = state.fork()
                if state.advance(token):
                    self.states[r] = state
                    self.kept[r].append(state)
                    chosen.append(token)
                else:
                    chosen.append(None)
        return chosen

    def keep_states(self) -> None:
        """Hand each constrained row its states after each draft, for verification."""
        for seq, kept in zip(self.seqs, self.kept):
            if seq.constraint is not None and seq.drafts is not None:
                seq.drafts.constraints = kept
