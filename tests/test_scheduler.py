from server.engine.block_pool import BlockPool
from server.engine.request import Sequence
from server.engine.scheduler import Schedule, Scheduler, enqueue
from tests.engine_driver import stub_rows


def seq(prompt_len: int, rows: int = 1) -> Sequence:
    return stub_rows(list(range(prompt_len)), rows).rows[0]


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for s in seqs:
        sched.add(s.request)


def advance(sched: Scheduler, plan: Schedule) -> None:
    """What the engine does after the forward pass: commit the step, append a sampled token."""
    for item in sched.update_from_output(plan):
        item.seq.token_ids.append(7)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=4)
    s = seq(10)
    add(sched, s)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        chunks.append([(i.num_new, i.samples) for i in plan.items])
        advance(sched, plan)
    assert chunks == [[(4, False)], [(4, False)], [(2, True)]]
    assert s.num_output == 1


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    a, b = seq(3), seq(3)
    add(sched, a, b)
    advance(sched, sched.schedule())  # both prompts fit: 3 + 3
    c = seq(20)
    add(sched, c)
    plan = sched.schedule()
    assert [(i.seq, i.num_new) for i in plan.items] == [(a, 1), (b, 1), (c, 4)]
    assert plan.num_tokens == 6


def test_requests_join_and_leave_between_steps() -> None:
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(2), seq(2), seq(2)
    for s in (a, b, c):
        add(sched, s)
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [a, b]  # max_num_seqs caps the running set
    advance(sched, plan)
    sched.remove(a.request)  # a finishes: its blocks return at once and c joins at the next step
    assert a.block_table == [] and a.request.rows == []
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [b, c]
    advance(sched, plan)
    sched.remove(b.request)
    sched.remove(c.request)
    assert pool.num_free == pool.num_blocks


def test_pool_exhaustion_preempts_the_youngest_and_resumes_it_later() -> None:
    pool = BlockPool(4, 2)  # 8 token slots
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    old, young = seq(3), seq(3)
    add(sched, old, young)
    advance(sched, sched.schedule())  # prompts: 2 blocks each, pool full
    advance(sched, sched.schedule())  # 4th token still fits in the 2nd block
    assert pool.num_free == 0 and len(old.token_ids) == 5
    plan = sched.schedule()  # both need a third block for their 5th token: the young one yields
    assert plan.preempted == [young.request]
    assert [i.seq for i in plan.items] == [old]
    assert young.num_computed == 0 and young.block_table == [] and sched.waiting[0] is young.request
    advance(sched, plan)
    sched.remove(old.request)
    plan = sched.schedule()  # recompute prompt + generated tokens, then sample the next
    assert [(i.seq, i.num_new, i.samples) for i in plan.items] == [(young, 5, True)]


def test_waiting_request_does_not_join_without_blocks_for_its_chunk() -> None:
    pool = BlockPool(2, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(8), seq(4)
    add(sched, a, b)
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [a] and list(sched.waiting) == [b.request]


def test_rows_of_one_request_sample_in_the_same_step() -> None:
    """Beams recomputed after preemption: when all rows cannot finish, each stops one short."""
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    first = seq(6, rows=3)
    rows = first.request.rows
    add(sched, first)
    plan = sched.schedule()
    assert [(i.seq, i.num_new, i.samples) for i in plan.items] == [
        (rows[0], 5, False),
        (rows[1], 3, False),
    ]
    advance(sched, plan)
    plan = sched.schedule()  # 1 + 3 + 6 = 10 > 8 still: nobody may reach the end alone
    assert all(not i.samples for i in plan.items)
    advance(sched, plan)
    plan = sched.schedule()
    assert [i.samples for i in plan.items] == [True, True, True]


def test_a_wide_request_waits_for_room_in_the_row_cap() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    narrow, wide = seq(2, rows=2), seq(2, rows=3)
    add(sched, narrow, wide)
    plan = sched.schedule()
    assert {i.seq.request for i in plan.items} == {narrow.request}  # 2 + 3 rows > 4


def test_waiting_requests_start_lowest_priority_first_then_in_arrival_order() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=1, max_num_batched_tokens=4)
    requests = {}
    for name, priority in (("a", 0), ("b", 1), ("c", -1), ("d", 0), ("e", -1)):
        requests[name] = stub_rows([1, 2])
        requests[name].priority = priority
        sched.add(requests[name])  # type: ignore[arg-type]
    assert [r.priority for r in sched.waiting] == [-1, -1, 0, 0, 1]
    order = {id(r): name for name, r in requests.items()}
    assert [order[id(r)] for r in sched.waiting] == ["c", "e", "a", "d", "b"]
    # a preempted request goes back first among the waiting ones of its priority (it arrived
    # before them), after those of a lower value
    late = stub_rows([1, 2])
    late.priority = 0
    enqueue(sched.waiting, late, preempted=True)  # type: ignore[arg-type]
    assert [order.get(id(r), "late") for r in sched.waiting] == ["c", "e", "late", "a", "d", "b"]
    plan = sched.schedule()
    assert {i.seq.request for i in plan.items} == {requests["c"]}
