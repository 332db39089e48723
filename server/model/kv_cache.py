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
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.cat([torch.arange(s * bs, (s + 1) * bs) for s, _ in pairs])
        dst = torch.cat([torch.arange(d * bs, (d + 1) * bs) for _, d in pairs])
        device = self.keys[0].device
        src, dst = to_device(src, device), to_device(dst, device)
        for pool in (*self.keys, *self.values):  # index_select copies src first
            pool.index_copy_(0, dst, pool.index_select(0, src))
