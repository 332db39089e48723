"""Reference-counted pool of fixed-size KV-cache blocks and per-sequence block tables.

Block ids index the preallocated cache tensors. A block may be shared by several sequences (beams,
`n` samples of one prompt); it returns to the pool when its last owner lets it go. Writing into a
shared block first needs a private copy (copy-on-write), which `ensure_writable` arranges.

Prefix caching (see prefix_cache.py) tags full, computed blocks with the hash of their contents.
A tagged block whose last owner lets it go is kept as *evictable* (LRU order) rather than freed, so
a later request with the same prefix can take it back (`acquire`). Allocation takes a free block
first, then evicts the least recently released tagged block. Evictable blocks count as free.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler answers with preemption."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unowned tagged blocks, LRU first
        self.evictions = 0  # cached blocks reused for other data

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks tagged with a prefix hash (owned or evictable)."""
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self.evictions += 1
            old_hash = self._hash_of[block]
            if old_hash is not None:  # evictable blocks are always tagged
                del self._by_hash[old_hash]
            self._hash_of[block] = None
        else:
            raise OutOfBlocks("KV cache pool exhausted")
        self._refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> list[int]:
        """Add an owner to every block of a table; returns a new table for the new owner."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one owner from every block of a table. Unowned blocks become free, or evictable
        if tagged; the table's later blocks are queued for eviction before its earlier ones, since
        a prefix is more likely to be shared than what follows it."""
        cached = []
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash_of[b] is None:
                    self._free.append(b)
                else:
                    cached.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than owned")
        for b in reversed(cached):
            self._evictable[b] = None
        blocks.clear()

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        """New blocks a table must gain to hold `num_tokens` tokens in all."""
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks to `table` until it holds `num_tokens` tokens (all or nothing)."""
        need = self.blocks_needed(table, num_tokens)
        if need > self.num_free:
            raise OutOfBlocks(f"need {need} blocks, {self.num_free} free")
        table.extend(self.allocate() for _ in range(need))

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks of `table` past those that hold its first `num_tokens` tokens (the
        slots of rejected speculative tokens)."""
        keep = -(-num_tokens // self.block_size)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.release(tail)

    def ensure_writable(self, table: list[int], index: int) -> tuple[int, int] | None:
        """Make `table[index]` private before a write. Returns (src, dst) if data must be copied.

        A tagged block is never written in place while others may find it by its hash: a sole owner
        untags it first (the engine only writes past its full blocks, so this is a safety net)."""
        block = table[index]
        if self._refs[block] == 1:
            self._untag(block)
            return None
        new = self.allocate()
        self._refs[block] -= 1
        table[index] = new
        return block, new

    # ---- prefix cache ---------------------------------------------------------------------------
    def cached_block(self, block_hash: bytes) -> int | None:
        """The block tagged with `block_hash`, if any (owned or evictable)."""
        return self._by_hash.get(block_hash)

    def acquire(self, block: int) -> None:
        """Add an owner to a tagged block found by its hash, reviving it if it was evictable."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def tag(self, block: int, block_hash: bytes) -> bool:
        """Tag an owned, full, computed block with its prefix hash. False (and no change) if the
        block is tagged already or another block holds that hash: one block per hash."""
        if self._hash_of[block] is not None or block_hash in self._by_hash:
            return False
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def _untag(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            del self._by_hash[h]
            self._hash_of[block] = None
