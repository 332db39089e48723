"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Running sequences go first (oldest first), each taking one decode token or its next prefill chunk,
under a per-step token budget so a long prompt never stalls everyone else. Waiting sequences join
while the budget, the sequence cap and the KV pool allow. When the pool cannot hold the running set,
the youngest running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.engine.block_pool import BlockPool, OutOfBlocks
from server.engine.model_runner import WorkItem
from server.engine.sequence import Sequence


@dataclass
class StepPlan:
    items: list[WorkItem] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new for i in self.items)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence, num_new: int, plan: StepPlan) -> None:
        """Give `seq` room for `num_new` more tokens, privately owned where they are written."""
        self.pool.grow(seq.block_table, seq.num_computed + num_new)
        bs = self.pool.block_size
        for index in range(seq.num_computed // bs, (seq.num_computed + num_new - 1) // bs + 1):
            copy = self.pool.ensure_writable(seq.block_table, index)
            if copy is not None:
                plan.copies.append(copy)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.pool.release(seq.block_table)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_pending, budget)
            try:
                self._reserve(seq, num_new, plan)
            except OutOfBlocks:
                victim = self.running.pop()
                self._preempt(victim, plan)
                continue
            plan.items.append(WorkItem(seq, num_new))
            budget -= num_new
            i += 1
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not plan.preempted
        ):
            seq = self.waiting[0]
            num_new = min(seq.num_pending, budget)
            if self.pool.blocks_needed(seq.block_table, seq.num_computed + num_new) > self.pool.num_free:
                break
            self._reserve(seq, num_new, plan)
            self.waiting.popleft()
            self.running.append(seq)
            plan.items.append(WorkItem(seq, num_new))
            budget -= num_new
        return plan

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and return its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.block_table)
