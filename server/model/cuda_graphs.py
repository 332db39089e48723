"""CUDA graphs of decode steps on the paged-kernel path, captured at start-up for known shapes.

When attention reads keys and values through the block tables (triton_attention.py), a step in
which every row adds one token has a shape fixed by its row count alone: the block tables have a
fixed width, the kernel's grid is one tile per row. So one graph per row bucket (1, 2, 4, ...,
max_num_seqs) serves every such step. They are captured once, at start-up, in the engine thread
(where they replay), largest first so that all of them share one memory pool, which the KV budget
reserves before it sizes the pool (kv_budget.py). A step copies its inputs into the graphs' static
buffers (rows beyond the step's write their key and value into a scratch block no sequence owns)
and replays the smallest graph that holds it; its logits are valid until the next replay.

With LoRA slots every bucket has a second graph, captured with an adapter step set whose slots
(and, off CUDA, masks) are static buffers too: a step with an adapter row copies its rows' slots
in and replays that one, the deltas inside it; a step of base rows replays the base graph, which
adds nothing.

On the CPU there is nothing to capture: `EagerGraph` stands in, re-running the captured function
on the same static buffers, so that everything but the capture itself is tested there (with the
kernel under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

from server.model.lora.modules import LoRAModules, LoRAStep
from server.model.paged_step import PagedStep, padded_tables
from server.step_plan import NO_ADAPTER

DecodeForward = Callable[[torch.Tensor, torch.Tensor, PagedStep], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


class EagerGraph:
    """The CPU's stand-in for a CUDA graph: replaying runs the function again, in place."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        self.output.copy_(self.fn())


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to and including max_rows: at most 2x padding per step."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(min(2 * sizes[-1], max_rows))
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        *,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        lora: LoRAModules | None = None,
    ) -> None:
        """`forward(input_ids [1, R], position_ids [1, R], step)` -> logits [R, V]: the decoder
        and LM head over the static buffers (`step` views them); `lora`: the model's adapter
        slots, for the adapter graphs."""
        self.forward = forward
        self.sizes = row_buckets(max_rows)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.device = device
        rows = self.sizes[-1]
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full(
            (rows, max_blocks), scratch_block, dtype=torch.int32, device=device
        )
        self.tile_seq = torch.arange(rows, dtype=torch.int32, device=device)
        self.tile_len = torch.ones(rows, dtype=torch.int32, device=device)
        self.tile_pos = torch.zeros(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.adapter_graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.lora = lora
        self.lora_rows = lora.static_step(rows) if lora is not None else None
        self.memory_pool: _POOL_HANDLE | None = None  # shared by every graph

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    @property
    def max_blocks(self) -> int:
        return self.tables.shape[1]

    def fits(self, tables: Sequence[list[int]]) -> bool:
        """Whether a decode step of rows with these block tables can replay a graph (else it
        runs eagerly): the graphs are captured (`capture`, at start-up) and one holds that many
        rows of that width."""
        return (
            bool(self.graphs)
            and len(tables) <= self.max_rows
            and all(len(t) <= self.max_blocks for t in tables)
        )

    def _step(self, rows: int) -> PagedStep:
        seq = self.tile_seq[:rows]
        return PagedStep(
            self.slots[:rows],
            self.tables[:rows],
            seq,
            seq,  # the tile of row i starts at packed token i
            self.tile_len[:rows],
            self.tile_pos[:rows],
            1,
            self.block_size,
        )

    def _bound(self, rows: int) -> Callable[[], torch.Tensor]:
        return functools.partial(
            self.forward,
            self.tokens[:rows].unsqueeze(0),
            self.positions[:rows].unsqueeze(0),
            self._step(rows),
        )

    def capture(self) -> None:
        """Record every bucket, largest first (later ones reuse the first one's memory), on one
        side stream."""
        stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        for rows in reversed(self.sizes):
            kinds = [(self.graphs, self._bound(rows))]
            if self.lora is not None:
                kinds.append((self.adapter_graphs, self._on_adapters(rows)))
            for graphs, fn in kinds:
                if stream is not None:
                    graphs[rows] = self._capture_cuda(fn, stream)
                else:
                    graph = EagerGraph(fn)
                    graphs[rows] = (graph, graph.output)

    def _on_adapters(self, rows: int) -> Callable[[], torch.Tensor]:
        """The bucket's forward with its rows' adapters read from the static slots."""
        lora, static = self.lora, self.lora_rows
        assert lora is not None and static is not None
        step = LoRAStep(static.slots[:rows], None if static.mask is None else static.mask[:rows])
        bound = self._bound(rows)

        def forward() -> torch.Tensor:
            outer, lora.state.step = lora.state.step, step
            try:
                return bound()
            finally:
                lora.state.step = outer

        return forward

    def _capture_cuda(
        self, fn: Callable[[], torch.Tensor], stream: torch.cuda.Stream
    ) -> tuple[Replayable, torch.Tensor]:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, caches fill
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
            output = fn()
        return graph, output

    def run(
        self,
        tables: list[list[int]],
        tokens: list[int],
        positions: list[int],
        edit_tokens: Callable[[torch.Tensor], None] = lambda t: None,
    ) -> torch.Tensor:
        """Logits [n, V] of n rows that add `tokens[i]` at `positions[i]`, each row's block table
        covering its position (n <= max_rows; tables no wider than max_blocks); `edit_tokens`
        may change the tokens on the device first."""
        n = len(tokens)
        rows = next(size for size in self.sizes if size >= n)
        bs = self.block_size
        # only the columns the rows use: the kernel reads no block past a row's last position,
        # and a full-width table (max_model_len / block_size columns) cost ms of host time
        table = padded_tables(tables, max(len(t) for t in tables))
        pos = torch.tensor(positions, dtype=torch.long)
        slots = table[torch.arange(n), pos // bs].long() * bs + pos % bs
        host = torch.stack([torch.tensor(tokens, dtype=torch.long), pos, slots])
        if self.device.type == "cuda":  # pinned: the copies do not wait for queued work
            host, table = host.pin_memory(), table.pin_memory()
        self.tokens[:n].copy_(host[0], non_blocking=True)
        edit_tokens(self.tokens[:n])
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.slots[:n].copy_(host[2], non_blocking=True)
        self.tile_pos[:n].copy_(host[1], non_blocking=True)
        self.tables[:n, : table.shape[1]].copy_(table, non_blocking=True)
        if rows > n:  # the padding rows write into the scratch block and attend to it alone
            self.slots[n:rows].fill_(self.scratch_slot)
            self.tile_pos[n:rows].zero_()
            self.tables[n:rows, 0].fill_(self.scratch_slot // bs)
        graphs = self.graphs
        if self.lora is not None and self.lora.in_use:
            self._put_adapters(n, rows)
            graphs = self.adapter_graphs
        graph, output = graphs[rows]
        graph.replay()
        return output[:n]

    def _put_adapters(self, n: int, rows: int) -> None:
        """The step's rows' adapter slots (and masks) into the static ones; padding rows none."""
        assert self.lora is not None and self.lora_rows is not None
        step, static = self.lora.state.step, self.lora_rows
        assert step is not None
        static.slots[:n].copy_(step.slots, non_blocking=True)
        static.slots[n:rows].fill_(NO_ADAPTER)
        if static.mask is not None and step.mask is not None:
            static.mask[:n].copy_(step.mask, non_blocking=True)
            static.mask[n:rows].zero_()
