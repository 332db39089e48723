"""Prefix caching: chained block hashes, evictable blocks, admission from the cache, and that the
engine's outputs are exactly those without the cache (greedy, n, beams, preemption, eviction)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import httpx
import pytest

from decoding import DecodingParams
from server.api.app import create_app
from server.cli import _add_serve_args
from server.config import load_config
from server.engine.block_pool import BlockPool
from server.engine.engine import Engine
from server.engine.prefix_cache import PrefixCache, hash_block
from server.engine.request import Sequence
from server.engine.scheduler import Schedule, Scheduler
from tests.conftest import make_engine, serving_context
from tests.engine_driver import Collected, generate, run_to_completion, stub_rows, submit
from tests.test_metrics_wiring import samples

GREEDY = DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---- block pool: tags, evictable blocks, eviction order ------------------------------------------
def filled_pool(num_blocks: int = 4) -> tuple[BlockPool, list[int]]:
    """A pool of blocks of 2 whose first two blocks are tagged and owned by `table`."""
    pool = BlockPool(num_blocks, block_size=2)
    table: list[int] = []
    pool.grow(table, 4)
    assert pool.tag(table[0], b"h0") and pool.tag(table[1], b"h1")
    return pool, table


def test_released_tagged_blocks_stay_findable_and_count_as_free() -> None:
    pool, table = filled_pool()
    blocks = list(table)
    pool.release(table)
    assert pool.num_free == 4 and pool.num_evictable == 2 and pool.num_cached == 2
    assert pool.cached_block(b"h0") == blocks[0] and pool.ref_count(blocks[0]) == 0
    pool.acquire(blocks[0])  # revived: owned again, no longer counted as free
    assert pool.num_free == 3 and pool.num_evictable == 1 and pool.ref_count(blocks[0]) == 1
    pool.acquire(blocks[0])  # a second owner of an owned block
    assert pool.num_free == 3 and pool.ref_count(blocks[0]) == 2


def test_allocation_takes_free_blocks_first_then_evicts_the_table_tail_first() -> None:
    pool, table = filled_pool()
    head, tail = table
    pool.release(table)
    fresh = [pool.allocate(), pool.allocate()]
    assert head not in fresh and tail not in fresh and pool.evictions == 0
    assert pool.allocate() == tail  # later blocks of a table are evicted before its prefix
    assert pool.cached_block(b"h1") is None and pool.cached_block(b"h0") == head
    assert pool.allocate() == head and pool.num_cached == 0 and pool.evictions == 2
    assert pool.num_free == 0


def test_least_recently_released_is_evicted_first() -> None:
    pool = BlockPool(2, block_size=1)
    a: list[int] = []
    b: list[int] = []
    pool.grow(a, 1)
    pool.grow(b, 1)
    pool.tag(a[0], b"a")
    pool.tag(b[0], b"b")
    first, second = b[0], a[0]
    pool.release(b)
    pool.release(a)
    assert pool.allocate() == first and pool.cached_block(b"a") == second


def test_one_block_per_hash_and_one_hash_per_block() -> None:
    pool, table = filled_pool()
    other: list[int] = []
    pool.grow(other, 2)
    assert not pool.tag(other[0], b"h0")  # the hash belongs to table[0]
    assert not pool.tag(table[0], b"h9")  # table[0] already has a hash
    pool.release(other)
    assert pool.num_evictable == 0 and pool.num_cached == 2


def test_copy_on_write_never_writes_into_a_block_others_can_find() -> None:
    pool, table = filled_pool()
    child = pool.share(table)
    copy = pool.ensure_writable(child, 1)  # shared tagged block: copied, the tagged one untouched
    assert copy == (table[1], child[1]) and pool.cached_block(b"h1") == table[1]
    pool.release(child)
    assert pool.ensure_writable(table, 1) is None  # sole owner may write, but untags it first
    assert pool.cached_block(b"h1") is None and pool.cached_block(b"h0") == table[0]
    pool.release(table)
    assert pool.num_free == 4 and pool.num_evictable == 1


# ---- hashing and attach --------------------------------------------------------------------------
def test_a_block_hash_depends_on_everything_before_it() -> None:
    same = hash_block(hash_block(b"", [1, 2]), [3, 4])
    assert same == hash_block(hash_block(b"", [1, 2]), [3, 4])
    assert same != hash_block(hash_block(b"", [9, 2]), [3, 4])
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])
    assert hash_block(b"", [1]) != hash_block(b"", [1 << 32])  # ids are not truncated


def computed_row(cache: PrefixCache, tokens: list[int]) -> Sequence:
    """A row whose tokens are all computed into fresh blocks, registered in the cache."""
    row = stub_rows(tokens).rows[0]
    cache.pool.grow(row.block_table, len(tokens))
    row.num_computed = len(tokens)
    cache.register(row, 0)
    return row


def test_attach_takes_the_longest_matching_run_and_leaves_a_token_to_compute() -> None:
    cache = PrefixCache(BlockPool(16, block_size=2))
    first = computed_row(cache, [1, 2, 3, 4, 5, 6, 7])  # blocks [1,2] [3,4] [5,6] are full
    assert cache.pool.num_cached == 3
    same = stub_rows([1, 2, 3, 4, 5, 6]).rows[0]  # all 3 blocks match, but the last token must run
    assert cache.attach(same) == 4 and same.block_table == first.block_table[:2]
    fork = stub_rows([1, 2, 3, 9, 5, 6, 7]).rows[
        0
    ]  # the 2nd block differs, so the 3rd cannot match
    assert cache.attach(fork) == 2 and fork.block_table == first.block_table[:1]
    assert cache.pool.ref_count(first.block_table[0]) == 3
    cache.detach(fork)
    assert fork.num_computed == 0 and fork.block_table == []
    assert cache.pool.ref_count(first.block_table[0]) == 2


# ---- scheduler: admission from the cache ---------------------------------------------------------
def advance(sched: Scheduler, plan: Schedule) -> None:
    """The engine's bookkeeping after a forward pass, with a fixed sampled token."""
    for item in sched.update_from_output(plan):
        item.seq.token_ids.append(7)


def test_a_second_request_computes_only_what_the_cache_lacks() -> None:
    pool = BlockPool(8, block_size=2)
    cache = PrefixCache(pool)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    a = stub_rows([1, 2, 3, 4, 5]).rows[0]
    sched.add(a.request)  # type: ignore[arg-type]
    plan = sched.schedule()
    assert [i.num_new for i in plan.items] == [5] and (plan.cache_queries, plan.cache_hits) == (
        5,
        0,
    )
    advance(sched, plan)
    sched.remove(a.request)  # type: ignore[arg-type]
    assert pool.num_free == 8 and pool.num_evictable == 2
    b = stub_rows([1, 2, 3, 4, 8, 9]).rows[0]
    sched.add(b.request)  # type: ignore[arg-type]
    plan = sched.schedule()
    assert [(i.seq, i.num_new) for i in plan.items] == [(b, 2)]
    assert (plan.cache_queries, plan.cache_hits) == (6, 4) and b.num_computed == 4
    assert pool.num_free == 8 - 3 and pool.num_evictable == 0


def test_revived_blocks_are_not_counted_free_twice() -> None:
    """2 free + 2 evictable blocks: a request hitting the 2 cached ones and needing 3 more waits,
    holding nothing, although 3 <= the 4 blocks that were 'free' before it revived its hits."""
    pool = BlockPool(4, block_size=2)
    cache = PrefixCache(pool)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    row = computed_row(cache, [1, 2, 3, 4])
    sched.release_row(row)
    assert pool.num_free == 4 and pool.num_evictable == 2
    wide = stub_rows([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).rows[0]  # 5 blocks, 2 of them cached
    sched.add(wide.request)  # type: ignore[arg-type]
    plan = sched.schedule()
    assert plan.items == [] and list(sched.waiting) == [wide.request]
    assert wide.block_table == [] and wide.num_computed == 0
    assert pool.num_free == 4 and pool.num_evictable == 2 and pool.num_cached == 2
    assert (plan.cache_queries, plan.cache_hits) == (0, 0)  # counted only once it joins


# ---- the engine: same tokens with and without the cache ------------------------------------------
def shared_prefix_prompts(seed: int, prefix_len: int, count: int) -> list[list[int]]:
    """`count` prompts: one common prefix, then suffixes of 3-9 tokens that differ at once."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 300) for _ in range(prefix_len)]
    return [
        prefix + [300 + i] + [rng.randrange(5, 300) for _ in range(rng.randint(2, 8))]
        for i in range(count)
    ]


def run_warm_then_rest(
    engine: Engine, prompts: list[list[int]], params: DecodingParams
) -> list[Collected]:
    """The first prompt alone (it fills the cache), then all the others in one batch."""
    first = generate(engine, prompts[:1], params)
    return first + generate(engine, prompts[1:], params)


def tokens(results: list[Collected]) -> list[dict]:
    return [r.choices() for r in results]


def assert_all_blocks_back(engine: Engine) -> None:
    pool = engine.pool
    assert pool.num_free == pool.num_blocks
    assert len(pool._free) + pool.num_evictable == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral"])
def test_greedy_outputs_are_identical_with_and_without_the_cache(
    tiny_model_dirs: dict[str, Path], arch: str
) -> None:
    prompts = shared_prefix_prompts(seed=1, prefix_len=41, count=5)  # 10 full blocks of 4 shared
    off = make_engine(tiny_model_dirs[arch], enable_prefix_caching=False)
    on = make_engine(tiny_model_dirs[arch])
    expected = tokens(run_warm_then_rest(off, prompts, GREEDY))
    assert tokens(run_warm_then_rest(on, prompts, GREEDY)) == expected
    assert on.stats.prefix_cache_queries == sum(map(len, prompts))
    assert on.stats.prefix_cache_hits == 4 * 40  # the 4 later prompts each skip 10 blocks
    assert on.stats.tokens_computed == off.stats.tokens_computed - 4 * 40
    assert (off.stats.prefix_cache_queries, off.stats.prefix_cache_hits) == (0, 0)
    assert off.pool.num_cached == 0
    assert_all_blocks_back(on)
    assert_all_blocks_back(off)


def test_the_same_prompt_again_computes_only_its_last_partial_block(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    prompt = shared_prefix_prompts(seed=2, prefix_len=20, count=1)[0]  # 20 + 1 + k tokens
    first = generate(engine, [prompt], GREEDY)[0]
    computed = engine.stats.tokens_computed
    got = submit(engine, "again", prompt, GREEDY)
    engine.step()  # the first step of the repeat: only the tokens past the cached blocks
    hit = (len(prompt) - 1) // 4 * 4
    assert engine.stats.tokens_computed - computed == len(prompt) - hit
    run_to_completion(engine)
    assert got.choices() == first.choices()
    assert engine.stats.prefix_cache_hits == hit


def test_generated_tokens_are_cached_too(llama_dir: Path) -> None:
    """A follow-up prompt that contains a previous answer (a chat turn) hits the answer's blocks."""
    engine = make_engine(llama_dir)
    prompt = shared_prefix_prompts(seed=3, prefix_len=12, count=1)[0][:12]  # 3 full blocks
    params = DecodingParams(max_tokens=10, temperature=0, ignore_eos=True)
    answer = generate(engine, [prompt], params)[0].token_ids
    follow_up = (
        prompt + answer + [42, 43]
    )  # 24 tokens: 21 were computed (the last answer token not)
    generate(engine, [follow_up], GREEDY)
    assert engine.stats.prefix_cache_hits == 20


def test_eviction_under_pool_pressure_keeps_outputs_exact(llama_dir: Path) -> None:
    """A pool of 40 blocks of 4: the cache keeps evicting while rows run next to cached blocks."""
    groups = [shared_prefix_prompts(seed=s, prefix_len=24, count=4) for s in range(4)]
    prompts = [p for pair in zip(*groups) for p in pair]  # interleaved, so prefixes come and go

    def run(engine: Engine) -> list[dict]:
        out = []
        for i in range(0, len(prompts), 3):  # three at a time, one batch after the other
            out += tokens(generate(engine, prompts[i : i + 3], GREEDY))
        return out

    on = make_engine(llama_dir, num_blocks=40)
    expected = run(make_engine(llama_dir, num_blocks=40, enable_prefix_caching=False))
    assert run(on) == expected
    assert on.pool.evictions > 0 and on.stats.prefix_cache_hits > 0
    assert on.pool.num_cached <= on.pool.num_blocks
    assert_all_blocks_back(on)


def test_evicted_blocks_are_never_served(llama_dir: Path) -> None:
    """A long prompt takes every block of a 16-block pool: the first prompt's cached prefix is gone,
    so its sibling must find nothing (and still get the exact tokens)."""
    first, sibling = shared_prefix_prompts(seed=7, prefix_len=24, count=2)
    filler = shared_prefix_prompts(seed=8, prefix_len=60, count=1)[0][:60]  # 63 computed: 16 blocks
    params = DecodingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(engine: Engine) -> list[dict]:
        return [
            r.choices() for p in (first, filler, sibling) for r in generate(engine, [p], params)
        ]

    on = make_engine(llama_dir, num_blocks=16)
    assert run(on) == run(make_engine(llama_dir, num_blocks=16, enable_prefix_caching=False))
    assert on.pool.evictions > 0 and on.stats.prefix_cache_hits == 0
    assert_all_blocks_back(on)


def test_a_block_matches_only_after_the_same_prefix(llama_dir: Path) -> None:
    """Same tokens in block 2, different block 1: nothing matches (the hash is chained)."""
    rng = random.Random(9)
    shared_middle = [rng.randrange(5, 300) for _ in range(8)]
    a = [1, 2, 3, 4, *shared_middle, 40, 41]
    b = [5, 6, 7, 8, *shared_middle, 40, 41]
    on = make_engine(llama_dir)
    off = make_engine(llama_dir, enable_prefix_caching=False)
    assert tokens(generate(on, [a], GREEDY) + generate(on, [b], GREEDY)) == tokens(
        generate(off, [a], GREEDY) + generate(off, [b], GREEDY)
    )
    assert on.stats.prefix_cache_hits == 0 and on.pool.num_cached == 2 * ((14 + 7) // 4)


def test_n_best_of_and_beams_over_a_cached_prefix_give_the_same_tokens(llama_dir: Path) -> None:
    prompts = shared_prefix_prompts(seed=4, prefix_len=30, count=4)
    cases = [
        DecodingParams(max_tokens=8, n=3, seed=11, ignore_eos=True),
        DecodingParams(max_tokens=8, n=2, best_of=3, seed=5, ignore_eos=True),
        DecodingParams(max_tokens=8, temperature=0, num_beams=3, n=2),
    ]

    def run(engine: Engine) -> list[dict]:
        out = tokens(generate(engine, prompts[:1], GREEDY))
        for i, params in enumerate(cases):
            out += tokens(generate(engine, [prompts[i + 1], prompts[0]], params))
        return out

    on = make_engine(llama_dir)
    assert run(on) == run(make_engine(llama_dir, enable_prefix_caching=False))
    # Each case: 28 prefix tokens (7 blocks) for the new prompt, and the cached first prompt's
    # blocks up to its last token.
    assert on.stats.prefix_cache_hits == 3 * (28 + (len(prompts[0]) - 1) // 4 * 4)
    assert_all_blocks_back(on)


def test_preempted_requests_resume_from_their_cached_blocks(llama_dir: Path) -> None:
    prompts = shared_prefix_prompts(seed=5, prefix_len=16, count=6)
    params = DecodingParams(max_tokens=24, temperature=0, ignore_eos=True)
    big = make_engine(llama_dir, enable_prefix_caching=False)
    expected = tokens(generate(big, prompts, params))
    small = make_engine(llama_dir, num_blocks=24)  # 96 slots for 6 rows of ~45 tokens
    assert tokens(generate(small, prompts, params)) == expected
    assert small.stats.preemptions > 0 and small.stats.prefix_cache_hits > 0
    assert_all_blocks_back(small)


# ---- configuration, metrics, engine stats --------------------------------------------------------
def test_the_flag_and_env_var_turn_the_cache_off() -> None:
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    args = vars(parser.parse_args(["--no-enable-prefix-caching"]))
    assert load_config(None, args, environ={}).enable_prefix_caching is False
    assert load_config(None, {}, environ={}).enable_prefix_caching is True
    env = {"BEAMLINE_ENABLE_PREFIX_CACHING": "false"}
    assert load_config(None, {}, environ=env).enable_prefix_caching is False
    args = vars(parser.parse_args(["--enable-prefix-caching"]))
    assert load_config(None, args, environ=env).enable_prefix_caching is True


@pytest.mark.parametrize("enabled", [True, False])
async def test_metrics_and_engine_stats_report_the_hits(llama_dir: Path, enabled: bool) -> None:
    ctx = serving_context(make_engine(llama_dir, enable_prefix_caching=enabled))
    prompt = shared_prefix_prompts(seed=6, prefix_len=20, count=1)[0]  # 21 + k tokens
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        app = create_app(ctx=ctx)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            texts, cached = [], []
            for _ in range(2):
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200
                texts.append(r.json()["choices"][0]["text"])
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            m = samples((await c.get("/metrics")).text)
            stats = (await c.get("/v1/engine/stats")).json()
    finally:
        ctx.engine.shutdown()
    hits = (len(prompt) - 1) // 4 * 4 if enabled else 0
    assert texts[0] == texts[1]
    assert cached == [0, hits]  # OpenAI's usage.prompt_tokens_details.cached_tokens
    queries = 2 * len(prompt) if enabled else 0
    assert m[("beamline:prefix_cache_queries_total", ())] == queries
    assert m[("beamline:prefix_cache_hits_total", ())] == hits
    assert stats["prefix_caching"] is enabled
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queries, hits)
    assert stats["prefix_cache_hit_rate"] == pytest.approx(hits / queries if enabled else 0.0)
    # Prompt blocks plus the 3 computed answer tokens' blocks stay cached (evictable), and free.
    assert stats["kv_blocks_cached"] == ((len(prompt) + 3) // 4 if enabled else 0)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
