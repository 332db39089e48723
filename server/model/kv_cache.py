"""The paged key/value pools every attention layer reads and writes: per layer, one flat tensor of
`num_blocks * block_size` slots (a block table maps a row's positions to its blocks' slots)."""

from __future__ import annotations

import torch

from decoding.transfer import to_device


class PagedKVCache:
    """Preallocated key/value pools: per layer, [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks * block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks): each
        pool seen as one row per block, so that a block is one index, not one per slot."""
        if not pairs:
            return
        device = self.keys[0].device
        src = to_device([s for s, _ in pairs], device, torch.long)
        dst = to_device([d for _, d in pairs], device, torch.long)
        for pool in (*self.keys, *self.values):  # index_select copies src first
            blocks = pool.view(-1, self.block_size * pool[0].numel())
            blocks.index_copy_(0, dst, blocks.index_select(0, src))
