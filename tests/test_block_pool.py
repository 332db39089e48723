import pytest

from server.engine.block_pool import BlockPool, OutOfBlocks


def test_allocate_and_release_return_every_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    table: list[int] = []
    pool.grow(table, 5)  # 5 tokens need 3 blocks of 2
    assert len(table) == 3 and pool.num_free == 1
    pool.release(table)
    assert table == [] and pool.num_free == 4


def test_grow_is_all_or_nothing_on_exhaustion() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    a: list[int] = []
    pool.grow(a, 4)
    b: list[int] = []
    with pytest.raises(OutOfBlocks):
        pool.grow(b, 8)  # needs 2, only 1 free
    assert b == [] and pool.num_free == 1


def test_shared_blocks_are_freed_by_their_last_owner() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    parent: list[int] = []
    pool.grow(parent, 6)
    child = pool.share(parent)
    assert child == parent and all(pool.ref_count(b) == 2 for b in parent)
    pool.release(parent)
    assert pool.num_free == 1  # still owned by the child
    pool.release(child)
    assert pool.num_free == 3


def test_copy_on_write_of_partial_last_block() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    parent: list[int] = []
    pool.grow(parent, 6)  # one full block, one partial
    child = pool.share(parent)
    copy = pool.ensure_writable(child, 1)
    assert copy == (parent[1], child[1]) and child[1] != parent[1]
    assert child[0] == parent[0]  # the full block stays shared
    assert pool.ref_count(parent[1]) == 1 and pool.ref_count(child[1]) == 1
    assert pool.ensure_writable(parent, 1) is None  # sole owner: write in place
    pool.release(parent)
    pool.release(child)
    assert pool.num_free == 4


def test_double_release_is_detected() -> None:
    pool = BlockPool(num_blocks=1, block_size=1)
    table: list[int] = []
    pool.grow(table, 1)
    stale = list(table)
    pool.release(table)
    with pytest.raises(RuntimeError):
        pool.release(stale)


def test_allocate_from_empty_pool_raises() -> None:
    pool = BlockPool(num_blocks=1, block_size=1)
    pool.allocate()
    with pytest.raises(OutOfBlocks):
        pool.allocate()
