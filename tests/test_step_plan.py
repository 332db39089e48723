"""The step plan: its one encoding round-trips every kind of change, and the block tables the model
side keeps from plan to plan (row_tables.py) always equal the rows' own, whatever the scheduler
did in between (admits, chunks, finishes, preemptions, beam and `n` forks, drafts kept and
rejected, copies on write, prefix-cache hits)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding import DecodingParams
from server.engine.block_pool import BlockPool
from server.engine.plan_builder import PlanBuilder
from server.engine.prefix_cache import PrefixCache
from server.engine.request import EngineRequest, Sequence
from server.engine.scheduler import Scheduler
from server.engine.speculation import add_drafts
from server.engine.work import ScoreSpan, WorkItem
from server.model.row_tables import RowTables
from server.step_plan import (
    AdapterInstall,
    DeferredTokens,
    PlanScore,
    SourceEncode,
    StepPlan,
    TableEdit,
    decode_plan,
    encode_plan,
)

SHAPES = {"q_proj": (8, 6), "v_proj": (8, 4), "o_proj": (6, 8)}  # (in, out) per projection


def full_plan() -> StepPlan:
    """A plan with one of everything: a scored prompt chunk of a new row, a decode row with
    drafts and a new block, a row whose last block was copied on write, one whose rejected
    drafts' blocks went back, a chunk that does not sample yet; releases, copies, LoRA slots,
    an install and deferred tokens."""
    a = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    b = torch.arange(6 * 2, dtype=torch.float32).view(6, 2) / 7
    o_a, o_b = torch.ones(1, 6), torch.full((8, 1), 0.5)
    return StepPlan(
        row_ids=[11, 4, 7, 9, 12],
        starts=[8, 39, 17, 30, 0],
        num_new=[12, 4, 1, 1, 5],
        num_drafts=[0, 3, 0, 0, 0],
        samples=[True, True, True, True, False],
        tokens=[*range(100, 112), 39, 7, 8, 9, 55, 66, *range(5)],
        table_edits=[
            TableEdit(0, 0, [3, 4, 5, 6, 7]),
            TableEdit(1, 10, [21]),
            TableEdit(2, 4, [22]),
            TableEdit(3, 8, []),
            TableEdit(4, 0, [23, 24]),
        ],
        released=[2, 3],
        copies=[(1, 22), (5, 6)],
        scores=[PlanScore(0, 8, 19, 2, list(range(109, 120)))],
        exact=[0, 4],
        exact_logits=[1, 2, 3, 4],
        lora_slots=[1, -1, 0, -1, 1],
        installs=[AdapterInstall(1, {"q_proj": (a, b), "o_proj": (o_a, o_b)})],
        deferred=DeferredTokens(torch.tensor([5, 6, 9]), [2, 3], [0, 2]),
        ranked=8,
    )


def assert_same(got: StepPlan, want: StepPlan) -> None:
    plain = [f for f in StepPlan.__dataclass_fields__ if f not in ("installs", "deferred")]
    for name in plain:
        assert getattr(got, name) == getattr(want, name), name
    assert [i.slot for i in got.installs] == [i.slot for i in want.installs]
    for mine, theirs in zip(got.installs, want.installs):
        assert mine.weights.keys() == theirs.weights.keys()
        for path, (a, b) in theirs.weights.items():
            assert torch.equal(mine.weights[path][0], a) and torch.equal(mine.weights[path][1], b)
    if want.deferred is None:
        assert got.deferred is None
    else:
        assert got.deferred is not None
        assert (got.deferred.rows, got.deferred.sources) == (
            want.deferred.rows,
            want.deferred.sources,
        )


def test_a_plan_with_every_kind_of_change_round_trips() -> None:
    plan = full_plan()
    data, floats = encode_plan(plan, list(SHAPES))
    assert all(isinstance(x, int) for x in data)
    assert floats is not None and floats.dtype == torch.float32
    assert plan.deferred is not None
    assert_same(decode_plan(data, floats, plan.deferred.values, SHAPES), plan)


@pytest.mark.parametrize(
    "plan",
    [
        StepPlan(),  # nothing at all
        StepPlan([1], [5], [1], [0], [True], [42]),  # one decode row, its table unchanged
        StepPlan(released=[3, 4], copies=[(0, 1)]),
        StepPlan([2], [0], [3], [0], [True], [1, 2, 3], lora_slots=[-1]),
        StepPlan(installs=[AdapterInstall(0, {})]),  # an adapter that changes nothing here
        # encoder-decoder rows: one past its source, one whose step writes its source
        StepPlan(
            [5, 6],
            [9, 0],
            [1, 4],
            [0, 0],
            [True, True],
            [7, 1, 2, 3, 0],
            source_lens=[6, 3],
            source_groups=[0, 1],  # two requests
            encodes=[SourceEncode(1, [1, 2, 3])],
            aligns=[0],  # its cross-attention scores asked for (word timestamps)
        ),
        StepPlan([5], [9], [1], [0], [True], [7], source_lens=[6]),  # no source in this step
        StepPlan([1, 2], [5, 5], [1, 1], [0, 0], [True, True], [4, 4], ranked=1),  # greedy rows
    ],
    ids=[
        "empty",
        "steady-decode",
        "releases-only",
        "base-row-with-lora-on",
        "empty-install",
        "sources",
        "sources-decoding",
        "ranked",
    ],
)
def test_small_plans_round_trip(plan: StepPlan) -> None:
    data, floats = encode_plan(plan, list(SHAPES))
    assert_same(decode_plan(data, floats, None, SHAPES), plan)


def test_a_prompt_that_scores_runs_exact_until_it_ends() -> None:
    """A request that asks for prompt logprobs: every chunk of its prompt is an `exact` row (the
    model side runs it through the floating-point weights), its generated tokens are not; a
    request that does not ask is never one."""
    builder = PlanBuilder(block_size=4, lora=False)
    rows = []
    for rid, top in (("scores", 1), ("plain", None)):
        req = EngineRequest(rid, [1, 2, 3, 4, 5], DecodingParams(prompt_logprobs=top), print)
        req.prepare(frozenset(), torch.device("cpu"), 64)
        rows.append(req.rows[0])
    scoring, plain = rows
    assert builder.build([WorkItem(scoring, 3), WorkItem(plain, 3)], [], []).exact == [0]
    scoring.num_computed = plain.num_computed = 3
    assert builder.build([WorkItem(plain, 2), WorkItem(scoring, 2)], [], []).exact == [1]
    scoring.num_computed, scoring.token_ids = 5, [1, 2, 3, 4, 5, 6]
    assert builder.build([WorkItem(scoring, 1)], [], []).exact == []


def test_rows_that_return_logprobs_name_their_logits_rows() -> None:
    """`exact_logits` counts the step's logits rows: one per sampling row, one more per draft;
    a chunk that does not sample has none."""
    builder = PlanBuilder(block_size=4, lora=False)
    rows = []
    for rid, logprobs, prompt in (("a", None, 3), ("b", 2, 3), ("c", 0, 6), ("d", 1, 4)):
        req = EngineRequest(rid, list(range(1, 7)), DecodingParams(logprobs=logprobs), print)
        req.prepare(frozenset(), torch.device("cpu"), 64)
        seq = req.rows[0]
        seq.num_computed = prompt
        rows.append(seq)
    a, b, c, d = rows
    items = [WorkItem(a, 3), WorkItem(b, 4, draft=[9]), WorkItem(c, 1), WorkItem(d, 1)]
    c.token_ids.append(7)  # c decodes its pending token, d's chunk stops short of its end
    d.token_ids.append(8)
    plan = builder.build(items, [], [])
    assert plan.samples == [True, True, True, False]
    assert plan.exact_logits == [1, 2, 3]  # a: row 0; b: rows 1-2 (a draft); c: row 3


def test_a_steady_decode_row_sends_no_table() -> None:
    """Only what changed travels: a decoding row inside its last block sends no block; its
    next block, when it reaches it, is the one entry sent."""
    builder = PlanBuilder(block_size=4, lora=False)
    req = EngineRequest("r", [1, 2, 3], DecodingParams(max_tokens=8), lambda o: None)
    req.prepare(frozenset(), torch.device("cpu"), 64)
    seq = req.rows[0]
    seq.block_table = [7]
    first = builder.build([WorkItem(seq, 3, ScoreSpan(0, 2, 1))], [], [])
    assert first.table_edits == [TableEdit(0, 0, [7])]
    assert first.scores == [PlanScore(0, 0, 2, 1, [2, 3])]
    seq.num_computed, seq.token_ids = 3, [1, 2, 3, 4]
    assert builder.build([WorkItem(seq, 1)], [], []).table_edits == []
    seq.num_computed, seq.token_ids, seq.block_table = 4, [1, 2, 3, 4, 5], [7, 9]
    second = builder.build([WorkItem(seq, 1)], [], [])
    assert second.table_edits == [TableEdit(0, 1, [9])] and second.tokens == [5]


def test_the_plan_says_how_many_likeliest_tokens_its_sampling_rows_read() -> None:
    """The most any sampling row reads (greedy 1, four beams 8, top-k 5); 0 once one sampling
    row reads the whole distribution (top-p), or has a grammar; rows that do not sample yet
    (a prompt chunk) do not count."""

    def row(params: DecodingParams, constrained: bool = False) -> Sequence:
        req = EngineRequest("r", [1, 2, 3], params, lambda o: None)
        if constrained:
            req.constraint = object()  # type: ignore[assignment]
        req.prepare(frozenset(), torch.device("cpu"), 64)
        req.rows[0].block_table = [7]
        return req.rows[0]

    def ranked(*rows: tuple[Sequence, bool]) -> int:
        items = [WorkItem(seq, 3 if samples else 2) for seq, samples in rows]  # 3: the prompt
        assert [item.samples for item in items] == [samples for _, samples in rows]
        return PlanBuilder(block_size=4, lora=False).build(items, [], []).ranked

    greedy = row(DecodingParams(temperature=0))
    beams = row(DecodingParams(num_beams=4, temperature=0))
    top_k = row(DecodingParams(temperature=1.0, top_k=5))
    top_p = row(DecodingParams(temperature=1.0, top_p=0.9))
    assert ranked((greedy, True)) == 1
    assert ranked((greedy, True), (beams, True), (top_k, True)) == 8
    assert ranked((greedy, True), (top_p, True)) == 0
    assert ranked((greedy, True), (top_p, False)) == 1  # a prompt chunk: no logits this step
    assert ranked((row(DecodingParams(temperature=0), constrained=True), True)) == 0


# ---- the property: the model side's tables follow the rows --------------------------------------
class Simulation:
    """The engine's bookkeeping around a scheduler, without a model: every sampled row gets a
    random token, beam requests re-fork their beams from random parents, drafts are kept up to
    a random point, requests end at random or at their length."""

    def __init__(self, rng: random.Random, *, blocks: int, caching: bool) -> None:
        self.rng = rng
        self.pool = BlockPool(blocks, 4)
        cache = PrefixCache(self.pool) if caching else None
        self.scheduler = Scheduler(self.pool, 6, 16, cache, drafter=self, adapters=None)
        self.builder = PlanBuilder(4, lora=False)
        self.model_side = RowTables()
        self.requests: list[EngineRequest] = []
        self.count = 0

    def add(
        self, items: list[WorkItem], budget: int, pool: BlockPool, copies: list[tuple[int, int]]
    ) -> None:
        add_drafts(items, budget, pool, self.propose)

    def propose(self, seq: Sequence, budget: int) -> list[int]:
        return [self.rng.randrange(50) for _ in range(min(budget, self.rng.randrange(4)))]

    def admit(self) -> None:
        kind = self.rng.choice(["one", "n", "beams"])
        params = {
            "one": DecodingParams(max_tokens=12, temperature=0.0),
            "n": DecodingParams(max_tokens=12, temperature=1.0, n=3),
            "beams": DecodingParams(max_tokens=12, num_beams=3),
        }[kind]
        prompt = [self.rng.randrange(3) for _ in range(self.rng.randrange(1, 14))]
        req = EngineRequest(str(self.count), prompt, params, lambda o: None)
        self.count += 1
        req.prepare(frozenset(), torch.device("cpu"), 64)
        self.requests.append(req)
        self.scheduler.add(req)

    def end(self, req: EngineRequest) -> None:
        self.scheduler.remove(req)
        self.requests.remove(req)

    def step(self) -> None:
        rng, sched = self.rng, self.scheduler
        if rng.random() < 0.4 or not self.requests:
            self.admit()
        if self.requests and rng.random() < 0.1:
            self.end(rng.choice(self.requests))
        schedule = sched.schedule(speculate=rng.random() < 0.7)
        plan = self.builder.build(schedule.items, schedule.copies, sched.take_released())
        data, floats = encode_plan(plan)
        tables = self.model_side.apply(decode_plan(data, floats))
        assert tables == [item.seq.block_table for item in schedule.items]
        self.check_model_side()
        sampling = sched.update_from_output(schedule)
        rows, _ = sched.fork_first_samples([item.seq for item in sampling])
        drafts = {item.seq: item.draft for item in sampling}
        beams: dict[EngineRequest, list[Sequence]] = {}
        for seq in rows:
            req = seq.request
            if req.search is not None:
                beams.setdefault(req, []).append(seq)
                continue
            draft = drafts.get(seq, [])
            kept = rng.randrange(len(draft) + 1)
            seq.token_ids += [*draft[:kept], rng.randrange(50)]
            if draft:
                sched.accept_drafts(seq, kept)
        for req, beam_rows in beams.items():
            parents = [rng.randrange(len(beam_rows)) for _ in beam_rows]
            sched.fork_beams(req, parents, [rng.randrange(50) for _ in beam_rows])
        for req in list(self.requests):
            if any(seq.num_output >= 12 or len(seq.token_ids) >= 60 for seq in req.rows):
                self.end(req)

    def check_model_side(self) -> None:
        """The model side holds exactly the rows it was sent and not released, each with the
        table the engine believes it has."""
        sent = {
            seq.seq_id: seq.model_table
            for req in self.requests
            for seq in req.rows
            if seq.model_table is not None
        }
        assert len(self.model_side) == len(sent)
        for row_id, table in sent.items():
            assert self.model_side[row_id] == table


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), blocks=st.integers(12, 40), caching=st.booleans())
def test_tables_kept_plan_by_plan_equal_the_rows_own(seed: int, blocks: int, caching: bool) -> None:
    sim = Simulation(random.Random(seed), blocks=blocks, caching=caching)
    for _ in range(40):
        sim.step()
    for req in list(sim.requests):
        sim.end(req)
    assert sim.pool.num_free == sim.pool.num_blocks
    sim.model_side.apply(sim.builder.build([], [], sim.scheduler.take_released()))
    assert len(sim.model_side) == 0  # every row released there too
