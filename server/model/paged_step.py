"""What the paged-attention kernel (triton_attention.py) reads of a step: `PagedStep`, the block
tables and the packed queries cut into tiles; and the block tables as one padded tensor, which the
gather path's steps (attention.py) build too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def padded_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables as one int32 [rows, width] host tensor, zero-padded (a row longer than
    `width` is cut). Row by row through numpy: 4x faster than torch.tensor on nested lists."""
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in zip(out, tables):
        row[: len(table)] = table[:width]
    return torch.from_numpy(out)


@dataclass
class PagedStep:
    """A step's metadata for the paged-attention kernel (triton_attention.py), which reads keys
    and values through the block tables itself: the packed queries cut into tiles of up to
    `block_q` tokens of one sequence."""

    slot_mapping: torch.Tensor  # [T] flat slot of each packed token
    block_tables: torch.Tensor  # [S, max_blocks] int32, one row per sequence in the step
    tile_seq: torch.Tensor  # [tiles] int32: the sequence (row of block_tables) of each tile
    tile_token: torch.Tensor  # [tiles] int32: packed index of the tile's first query
    tile_len: torch.Tensor  # [tiles] int32: queries in the tile (<= block_q)
    tile_pos: torch.Tensor  # [tiles] int32: position of the tile's first query in its sequence
    block_q: int  # query tokens per tile (1 when every sequence adds one token)
    block_size: int  # tokens per KV block

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        starts: list[int],
        num_new: list[int],
        block_size: int,
        device: torch.device,
    ) -> PagedStep:
        """Sequence i adds tokens at positions starts[i] .. starts[i] + num_new[i] - 1, packed in
        order; `tables[i]` covers them. Built on the host, copied without blocking the host."""
        block_q = 1 if max(num_new) == 1 else 16
        table = padded_tables(tables, max(len(t) for t in tables))
        tiles: list[tuple[int, int, int, int]] = []  # (seq, first token, length, first pos)
        first = 0
        for i, (start, n) in enumerate(zip(starts, num_new)):
            tiles += [(i, first + o, min(block_q, n - o), start + o) for o in range(0, n, block_q)]
            first += n
        counts = torch.tensor(num_new)
        rows = torch.repeat_interleave(torch.arange(len(tables)), counts)
        packed_first = counts.cumsum(0) - counts  # packed index of each sequence's first token
        shift = torch.tensor(starts) - packed_first  # position minus packed index, per sequence
        pos = torch.arange(first) + torch.repeat_interleave(shift, counts)
        slots = table[rows, pos // block_size].long() * block_size + pos % block_size
        # [4, tiles] padded to a multiple of 4 columns: each row starts 16-byte aligned, so the
        # kernel's pointer specialisation is the same whatever the number of tiles (no recompile)
        meta = torch.zeros((4, -(-len(tiles) // 4) * 4), dtype=torch.int32)
        meta[:, : len(tiles)] = torch.tensor(tiles, dtype=torch.int32).T
        if device.type == "cuda":
            slots, table, meta = slots.pin_memory(), table.pin_memory(), meta.pin_memory()
        slots, table, meta = (t.to(device, non_blocking=True) for t in (slots, table, meta))
        seq, token, length, pos = meta[:, : len(tiles)]
        return cls(slots, table, seq, token, length, pos, block_q, block_size)
