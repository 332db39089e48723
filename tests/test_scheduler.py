from server.engine.block_pool import BlockPool
from server.engine.scheduler import Scheduler, StepPlan
from server.engine.sequence import Sequence


def seq(prompt_len: int) -> Sequence:
    return Sequence(request=None, token_ids=list(range(prompt_len)), prompt_len=prompt_len)  # type: ignore[arg-type]


def advance(plan: StepPlan) -> None:
    """What the engine does after the forward pass: mark computed, append a sampled token."""
    for item in plan.items:
        samples = item.samples
        item.seq.num_computed += item.num_new
        if samples:
            item.seq.token_ids.append(7)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=4)
    s = seq(10)
    sched.add(s)
    chunks = []
    for _ in range(3):
        plan = sched.schedule()
        chunks.append([(i.num_new, i.samples) for i in plan.items])
        advance(plan)
    assert chunks == [[(4, False)], [(4, False)], [(2, True)]]
    assert s.num_output == 1


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    sched = Scheduler(BlockPool(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    a, b = seq(3), seq(3)
    sched.add(a)
    sched.add(b)
    advance(sched.schedule())  # both prompts fit: 3 + 3
    c = seq(20)
    sched.add(c)
    plan = sched.schedule()
    assert [(i.seq, i.num_new) for i in plan.items] == [(a, 1), (b, 1), (c, 4)]
    assert plan.num_tokens == 6


def test_requests_join_and_leave_between_steps() -> None:
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(2), seq(2), seq(2)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [a, b]  # max_num_seqs caps the running set
    advance(plan)
    sched.remove(a)  # a finishes: its blocks return at once and c joins at the next step
    assert a.block_table == []
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [b, c]
    advance(plan)
    sched.remove(b)
    sched.remove(c)
    assert pool.num_free == pool.num_blocks


def test_pool_exhaustion_preempts_the_youngest_and_resumes_it_later() -> None:
    pool = BlockPool(4, 2)  # 8 token slots
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    old, young = seq(3), seq(3)
    sched.add(old)
    sched.add(young)
    advance(sched.schedule())  # prompts: 2 blocks each, pool full
    advance(sched.schedule())  # 4th token still fits in the 2nd block
    assert pool.num_free == 0 and len(old.token_ids) == 5
    plan = sched.schedule()  # both need a third block for their 5th token: the young one yields
    assert plan.preempted == [young]
    assert [i.seq for i in plan.items] == [old]
    assert young.num_computed == 0 and young.block_table == [] and sched.waiting[0] is young
    advance(plan)
    sched.remove(old)
    plan = sched.schedule()  # recompute prompt + generated tokens, then sample the next
    assert [(i.seq, i.num_new, i.samples) for i in plan.items] == [(young, 5, True)]


def test_waiting_request_does_not_join_without_blocks_for_its_chunk() -> None:
    pool = BlockPool(2, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(8), seq(4)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [a] and list(sched.waiting) == [b]
