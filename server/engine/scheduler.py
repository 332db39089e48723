"""Iteration-level scheduling: which requests run in the next step, and how many tokens each row.

The unit is the request (its rows: one sequence, or its `n` samples, or its beams), because a
request's rows must sample in the same step: beam search needs every beam's scores at once.
Running requests go first (oldest first), each row taking one decode token or its next prefill
chunk, under a per-step token budget so a long prompt never stalls everyone else. When a request's
rows cannot all finish their pending tokens in this step, each row stops one token short so they
all sample together later. Waiting requests join while the budget, the row cap and the KV pool
allow, lowest `priority` first, then in arrival order. When the pool cannot hold the running set,
the youngest running request is preempted (whatever its priority): its blocks are freed and it is
recomputed later.

With speculation (speculation.py), a running row that decodes may add draft tokens after its own,
from the budget and the free blocks that remain once every running and admitted row has its
share (drafts never preempt or delay anyone); once verified, the row keeps the accepted ones
(`accept_drafts`) and the blocks of the rejected ones are freed.

With prefix caching, a waiting request's rows first take over the cached blocks of their leading
tokens (prefix_cache.py), so only the rest is computed and counted against the pool; a request that
then cannot join gives them back.

With LoRA adapters, a running request holds a device slot for its adapter (adapters.py); a waiting
request whose adapter has no slot to go to is passed over until one frees, and the requests behind
it may join meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.engine.adapters import AdapterSlots
from server.engine.block_pool import BlockPool, OutOfBlocks
from server.engine.prefix_cache import PrefixCache
from server.engine.request import EngineRequest, Sequence
from server.engine.work import Drafter, WorkItem


@dataclass
class Schedule:
    """The scheduler's decision for one step over live rows (the engine builds the model side's
    `StepPlan` from it: plan_builder.py)."""

    items: list[WorkItem] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[EngineRequest] = field(default_factory=list)
    cache_queries: int = 0  # tokens of admitted rows looked up in the prefix cache
    cache_hits: int = 0  # of those, tokens found there (not computed again)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new for i in self.items)


def plan_rows(rows: list[Sequence], budget: int) -> list[WorkItem]:
    """Chunks for one request's rows: all to the end if they fit, else each stops one short."""
    pending = [s.num_pending for s in rows]
    if sum(pending) <= budget:
        return [WorkItem(s, p) for s, p in zip(rows, pending) if p > 0]
    items = []
    for seq, p in zip(rows, pending):
        n = min(p - 1, budget)
        if n > 0:
            items.append(WorkItem(seq, n))
            budget -= n
    return items


def enqueue(waiting: deque[EngineRequest], request: EngineRequest, preempted: bool = False) -> None:
    """Waiting requests start lowest `priority` first (vLLM's meaning; 0 by default), in arrival
    order within a priority: a new request goes after every waiting one not above it, a
    preempted one (it arrived before them) before every one not below it."""
    priority = request.priority
    if not preempted and (not waiting or waiting[-1].priority <= priority):
        waiting.append(request)  # the common case: no priorities
        return
    behind = (
        (i for i, w in enumerate(waiting) if w.priority >= priority)
        if preempted
        else (i for i, w in enumerate(waiting) if w.priority > priority)
    )
    waiting.insert(next(behind, len(waiting)), request)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
        drafter: Drafter | None = None,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.pool = pool
        self.adapters = adapters or AdapterSlots(0)  # LoRA slots (none: no adapters served)
        self.prefix_cache = prefix_cache
        self.drafter = drafter  # adds drafts to a step's decoding rows (speculation.py)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.released: list[int] = []  # rows whose blocks went back since `take_released`

    def _free_row(self, seq: Sequence) -> None:
        """Return a row's blocks; the model side forgets its table with the next plan."""
        self.pool.release(seq.block_table)
        if seq.model_table is not None:
            seq.model_table = None
            self.released.append(seq.seq_id)

    def take_released(self) -> list[int]:
        """Rows freed since the last call, whose tables the model side may forget."""
        released, self.released = self.released, []
        return released

    def add(self, request: EngineRequest) -> None:
        enqueue(self.waiting, request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_rows(self) -> int:
        return sum(r.width for r in self.running)

    def _reserve(self, seq: Sequence, num_new: int, plan: Schedule) -> None:
        """Give `seq` room for `num_new` more tokens, privately owned where they are written."""
        bs = self.pool.block_size
        if num_new == 1 and seq.num_computed < len(seq.block_table) * bs:  # a decode row's slot:
            copy = self.pool.ensure_writable(seq.block_table, seq.num_computed // bs)  # its block
            if copy is not None:  # is there; shared (a fork), it is copied first
                plan.copies.append(copy)
            return
        self.pool.grow(seq.block_table, seq.num_computed + num_new)
        for index in range(seq.num_computed // bs, (seq.num_computed + num_new - 1) // bs + 1):
            copy = self.pool.ensure_writable(seq.block_table, index)
            if copy is not None:
                plan.copies.append(copy)

    def _blocks_needed(self, items: list[WorkItem]) -> int:
        return sum(
            self.pool.blocks_needed(i.seq.block_table, i.seq.num_computed + i.num_new)
            for i in items
        )

    def _attach_cached(self, request: EngineRequest) -> tuple[int, int]:
        """Point the rows with nothing computed at their cached prefix: (queried, hit) tokens.
        A prompt still to be scored (prompt logprobs, cross-attention scores) takes cached blocks
        only before the first position it must score (EngineRequest.cache_limit)."""
        queried = hit = 0
        if self.prefix_cache is not None:
            limit = request.cache_limit
            for seq in request.rows:
                if seq.num_computed == 0 and not seq.block_table:
                    queried += len(seq.token_ids)
                    hit += self.prefix_cache.attach(seq, limit)
        return queried, hit

    def _detach_cached(self, request: EngineRequest) -> None:
        """A waiting request that does not join holds no blocks (it keeps nothing computed)."""
        if self.prefix_cache is not None:
            for seq in request.rows:
                self.prefix_cache.detach(seq)

    def _preempt(self, request: EngineRequest, plan: Schedule) -> None:
        for seq in request.rows:
            self._free_row(seq)
            seq.num_computed = 0
        self.adapters.free(request)
        enqueue(self.waiting, request, preempted=True)
        plan.preempted.append(request)

    def schedule(self, speculate: bool = True) -> Schedule:
        """The next step; `speculate` False: no drafts (a row's last token is still on the device
        with async scheduling, and drafts are looked up from it)."""
        plan = Schedule()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if len(request.rows) == 1 and request.rows[0].num_pending == 1:  # a decode row
                items = [WorkItem(request.rows[0], 1)]  # (plan_rows' answer, without its work)
            else:
                items = plan_rows(request.rows, budget)
            try:
                for item in items:
                    self._reserve(item.seq, item.num_new, plan)
            except OutOfBlocks:
                self._preempt(self.running.pop(), plan)
                continue
            plan.items.extend(items)
            budget -= sum(item.num_new for item in items)
            i += 1
        j = 0  # the first waiting request not passed over (its adapter waiting for a slot)
        while j < len(self.waiting) and budget > 0 and not plan.preempted:
            request = self.waiting[j]
            if self.running and self.num_running_rows + request.width > self.max_num_seqs:
                break
            if self.adapters.waits(request):
                j += 1
                continue
            queried, hit = self._attach_cached(request)  # revived blocks no longer count as free
            items = plan_rows(request.rows, budget)
            if not items or self._blocks_needed(items) > self.pool.num_free:
                self._detach_cached(request)
                break
            try:
                for item in items:
                    self._reserve(item.seq, item.num_new, plan)
            except OutOfBlocks:  # only possible with shared blocks to copy; retry next step
                self._detach_cached(request)
                break
            plan.cache_queries += queried
            plan.cache_hits += hit
            del self.waiting[j]
            self.adapters.hold(request)
            self.running.append(request)
            plan.items.extend(items)
            budget -= sum(item.num_new for item in items)
        if speculate and self.drafter is not None and budget > 0:  # last: take what is left
            self.drafter.add(plan.items, budget, self.pool, plan.copies)
        return plan

    def accept_drafts(self, seq: Sequence, accepted: int) -> None:
        """A verified row keeps `accepted` of its drafts (already appended to its tokens): they
        are computed; the slots after them held rejected ones, blocks past them are freed."""
        if seq.retired:
            return
        seq.num_computed += accepted
        if self.prefix_cache is not None and accepted:
            self.prefix_cache.register(seq, seq.num_computed - accepted)
        self.pool.shrink(seq.block_table, len(seq.token_ids))

    def update_from_output(self, plan: Schedule) -> list[WorkItem]:
        """The step ran: its tokens are in the cache, and every block it filled is offered to the
        prefix cache. Returns the items whose rows sample now (their chunk reached the end)."""
        sampling = []
        cache, bs = self.prefix_cache, self.pool.block_size
        for item in plan.items:
            if item.samples:
                sampling.append(item)
            seq = item.seq
            if seq.retired:  # ended by a stop string while the step ran (overlapped outputs)
                continue
            computed = item.num_new - len(item.draft)  # drafts count once accepted
            before = seq.num_computed
            seq.num_computed += computed
            if cache is not None and seq.num_computed // bs > before // bs:  # a block filled
                cache.register(seq, before)
        return sampling

    def fork_row(
        self, parent: Sequence, token_ids: list[int], index: int, last_child: bool = False
    ) -> Sequence:
        """A new row of `parent`'s request that shares every KV block of `parent` (copy-on-write
        of a partly filled last block happens when either writes into it): beams, n, best_of.
        The child gets a copy of the parent's constraint state; the `last_child` of a parent
        that is going away takes the state itself."""
        child = Sequence(parent.request, token_ids, parent.prompt_len, index=index)
        child.num_computed = parent.num_computed
        child.draft_computed = parent.draft_computed
        child.block_table = self.pool.share(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        if parent.constraint is not None:
            child.constraint = parent.constraint if last_child else parent.constraint.fork()
        return child

    def fork_beams(self, req: EngineRequest, parents: list[int], tokens: list[int]) -> None:
        """Replace a beam request's rows by their children: row `parents[i]` + `tokens[i]`."""
        old = req.rows
        last = {p: i for i, p in enumerate(parents)}
        req.rows = [
            self.fork_row(old[p], [*old[p].token_ids, token], index=i, last_child=last[p] == i)
            for i, (p, token) in enumerate(zip(parents, tokens))
        ]
        for parent in old:
            self.release_row(parent)

    def fork_first_samples(self, rows: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
        """A request with n / best_of > 1 prefills its prompt once, as one row; at its first
        sample that row forks into its width, the children sharing the prompt's blocks. Returns
        the rows that sample now and, when any forked, the input row each one samples from."""

        def expands(seq: Sequence) -> bool:
            req = seq.request
            return (  # cheapest test first: a row with output never expands
                not seq.num_output and req.search is None and req.width > 1 and len(req.rows) == 1
            )

        if not any(expands(seq) for seq in rows):
            return rows, None
        out_rows: list[Sequence] = []
        index: list[int] = []
        for r, seq in enumerate(rows):
            if expands(seq):
                req = seq.request
                req.rows.extend(
                    self.fork_row(seq, list(seq.token_ids), k) for k in range(1, req.width)
                )
                out_rows.extend(req.rows)
                index.extend([r] * req.width)
            else:
                out_rows.append(seq)
                index.append(r)
        return out_rows, index

    def release_row(self, seq: Sequence) -> None:
        """A row leaves its request (finished, or replaced by its beam children): free its
        blocks."""
        self._free_row(seq)

    def remove(self, request: EngineRequest) -> None:
        """Take a finished or aborted request out and return all its blocks at once."""
        if request in self.running:
            self.running.remove(request)
            self.adapters.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for seq in request.rows:
            self._free_row(seq)
        request.rows.clear()
