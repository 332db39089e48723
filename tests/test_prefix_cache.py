"""Prefix caching: chained block hashes, evictable blocks, admission from the cache, and that the
engine's outputs are exactly those without the cache (greedy, n, beams, preemption, eviction)."""

from __future__ import annotations

from decoding import DecodingParams
from server.engine.block_pool import BlockPool

GREEDY = DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---- block pool: tags, evictable blocks, eviction order ----------------------------------------------
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
