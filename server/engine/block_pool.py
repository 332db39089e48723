"""Reference-counted pool of fixed-size KV-cache blocks and per-sequence block tables.

Block ids index the preallocated cache tensors. A block may be shared by several sequences (beams,
`n` samples of one prompt); it returns to the free list when its last owner lets it go. Writing
into a shared block first needs a private copy (copy-on-write), which `ensure_writable` arranges.
"""

from __future__ import annotations

from collections import deque


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("KV cache pool exhausted")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def share(self, blocks: list[int]) -> list[int]:
        """Add an owner to every block of a table; returns a new table for the new owner."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop one owner from every block of a table; blocks with no owner left are free."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
            elif self._refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than owned")
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

    def ensure_writable(self, table: list[int], index: int) -> tuple[int, int] | None:
        """Make `table[index]` private before a write. Returns (src, dst) if data must be copied."""
        block = table[index]
        if self._refs[block] == 1:
            return None
        new = self.allocate()
        self._refs[block] -= 1
        table[index] = new
        return block, new
