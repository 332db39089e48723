"""How a step reaches the other ranks of a tensor-parallel group: the driver (rank 0) broadcasts
what it hands its own model runner, as tensors, and every other rank rebuilds the same work
items and runs the same `ModelRunner.execute`, so every rank packs the same step and meets the
driver at every collective of the forward (as vLLM's workers rebuild their inputs from the
scheduler's output).

Each message is a header (op, payload length, float and deferred lengths) and an int32 payload:
the block copies, then per item its counts (computed, new, length, drafts, adapter slot, scored
span, table length) and its new tokens, drafts and block table. Async scheduling's deferred
tokens (on the device) follow as a tensor of their own; a LoRA install sends the adapter's A and
B matrices, whole, as one float tensor (each rank keeps its part).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from server.model.lora import LoRAModules
from server.model.lora_files import LoRAAdapter
from server.model.tp_group import TPGroup
from server.work import DeferredTokens, ScoreSpan, StepOutput, WorkItem

STEP, ADAPTER, STOP = 1, 2, 3
HEADER = 4  # op, payload length, float payload length, deferred tokens
ITEM_FIELDS = 10


class TokenWindow:
    """A row's tokens as far as a step reads them: `tokens` from position `offset` on; a read
    elsewhere gives 0 (another rank's scored targets, which only the driver reduces)."""

    __slots__ = ("offset", "tokens", "length")

    def __init__(self, offset: int, tokens: list[int], length: int) -> None:
        self.offset, self.tokens, self.length = offset, tokens, length

    def __len__(self) -> int:
        return self.length

    def _at(self, i: int) -> int:
        j = i - self.offset
        return self.tokens[j] if 0 <= j < len(self.tokens) else 0

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step == 1 and start == self.offset:  # the step's own tokens: each step reads them
                return self.tokens[: max(stop - start, 0)]
            return [self._at(i) for i in range(start, stop, step)]
        return self._at(key)


@dataclass(slots=True)
class MirroredRow:
    """A row rebuilt on a follower rank: what `Row` says a model runner reads."""

    token_ids: TokenWindow
    num_computed: int
    block_table: list[int]
    lora_slot: int


def encode_step(
    items: Sequence[WorkItem], copies: list[tuple[int, int]], deferred: DeferredTokens | None
) -> list[int]:
    data = [len(items), len(copies)]
    for src, dst in copies:
        data += (src, dst)
    tails: list[int] = []
    for item in items:
        seq, start = item.seq, item.seq.num_computed
        tokens = seq.token_ids[start : start + item.num_new]
        span = item.score or ScoreSpan(-1, -1, -1)
        data += (start, item.num_new, len(seq.token_ids), len(tokens), len(item.draft))
        data += (seq.lora_slot, span.start, span.stop, span.num_top, len(seq.block_table))
        tails += tokens
        tails += item.draft
        tails += seq.block_table
    if deferred is not None:
        tails += (len(deferred.items), *deferred.items, *deferred.sources)
    return data + tails


def decode_step(
    data: list[int], values: torch.Tensor | None
) -> tuple[list[WorkItem], list[tuple[int, int]], DeferredTokens | None]:
    num_items, num_copies = data[0], data[1]
    copies = [(data[2 + 2 * i], data[3 + 2 * i]) for i in range(num_copies)]
    at = 2 + 2 * num_copies
    tail = at + ITEM_FIELDS * num_items
    items: list[WorkItem] = []
    for i in range(num_items):
        start, num_new, length, n_tokens, n_draft, slot, s0, s1, top, n_table = data[
            at + ITEM_FIELDS * i : at + ITEM_FIELDS * (i + 1)
        ]
        bounds = list(accumulate((tail, n_tokens, n_draft, n_table)))
        tokens, draft, table = (data[a:b] for a, b in zip(bounds, bounds[1:]))
        tail = bounds[-1]
        row = MirroredRow(TokenWindow(start, tokens, length), start, table, slot)
        score = ScoreSpan(s0, s1, top) if s0 >= 0 else None
        items.append(WorkItem(row, num_new, score, draft))
    deferred = None
    if values is not None:
        n = data[tail]
        deferred = DeferredTokens(values, data[tail + 1 : tail + 1 + n], data[tail + 1 + n :])
    return items, copies, deferred


class StepBroadcast:
    """The driver's side: each step, adapter install and the end, sent to every other rank."""

    def __init__(self, group: TPGroup, lora_paths: list[str]) -> None:
        self.group = group
        self.lora_paths = lora_paths

    @classmethod
    def of_driver(cls, group: TPGroup | None, lora: LoRAModules | None) -> StepBroadcast | None:
        """The driver's broadcast (None on one rank, or on a follower), which also sends every
        adapter `lora` installs."""
        if group is None or not group.is_driver:
            return None
        broadcast = cls(group, list(lora.targets) if lora else [])
        if lora is not None:
            lora.mirror = broadcast.adapter
        return broadcast

    def _send(self, op: int, payload: list[int], floats: int = 0, deferred: int = 0) -> None:
        header = torch.tensor([op, len(payload), floats, deferred], dtype=torch.long)
        self.group.broadcast(header)
        if payload:
            self.group.broadcast(torch.tensor(payload, dtype=torch.int32))

    def step(
        self,
        items: Sequence[WorkItem],
        copies: list[tuple[int, int]],
        deferred: DeferredTokens | None,
    ) -> None:
        values = 0 if deferred is None else len(deferred.values)
        self._send(STEP, encode_step(items, copies, deferred), deferred=values)
        if deferred is not None:
            self.group.broadcast(deferred.values)

    def adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        payload = [slot]
        parts: list[torch.Tensor] = []
        for path in self.lora_paths:
            weights = adapter.weights.get(path)
            payload.append(0 if weights is None else weights[0].shape[0])
            if weights is not None:
                parts += (weights[0].reshape(-1), weights[1].reshape(-1))
        flat = torch.cat(parts) if parts else torch.empty(0)
        self._send(ADAPTER, payload, floats=len(flat))
        if len(flat):
            self.group.broadcast(flat.float())

    def stop(self) -> None:
        self._send(STOP, [])


def unpack_adapter(
    payload: list[int], flat: torch.Tensor, shapes: dict[str, tuple[int, int]]
) -> tuple[int, LoRAAdapter]:
    """The slot and the adapter (whole, on the host) of an ADAPTER message."""
    slot, ranks = payload[0], payload[1:]
    weights = {}
    at = 0
    for (path, (in_features, out_features)), rank in zip(shapes.items(), ranks):
        if not rank:
            continue
        a = flat[at : at + rank * in_features].view(rank, in_features)
        at += rank * in_features
        b = flat[at : at + out_features * rank].view(out_features, rank)
        at += out_features * rank
        weights[path] = (a, b)
    return slot, LoRAAdapter(f"slot-{slot}", Path(), weights)


class StepFollower:
    """A follower rank's loop: run what the driver broadcasts until it says stop (`execute`:
    its model runner's; `install`: its LoRA slots' install, if any)."""

    def __init__(
        self,
        group: TPGroup,
        execute: Callable[..., StepOutput],
        install: Callable[[int, LoRAAdapter], None] | None,
        lora_shapes: dict[str, tuple[int, int]],
    ) -> None:
        self.group = group
        self.execute = execute
        self.install = install
        self.lora_shapes = lora_shapes

    @classmethod
    def of(cls, group: TPGroup, execute: Callable[..., StepOutput], lora: LoRAModules | None):
        if lora is None:
            return cls(group, execute, None, {})
        return cls(group, execute, lora.install, lora.targets)

    def run(self) -> None:
        while True:
            op, length, floats, deferred = self.group.broadcast(
                torch.empty(HEADER, dtype=torch.long)
            ).tolist()
            payload = (
                self.group.broadcast(torch.empty(length, dtype=torch.int32)).tolist()
                if length
                else []
            )
            if op == STOP:
                return
            if op == ADAPTER:
                flat = self.group.broadcast(torch.empty(floats)) if floats else torch.empty(0)
                slot, adapter = unpack_adapter(payload, flat, self.lora_shapes)
                assert self.install is not None, "an adapter for a rank without LoRA"
                self.install(slot, adapter)
                continue
            values = None
            if deferred:
                buffer = torch.empty(deferred, dtype=torch.long, device=self.group.device)
                values = self.group.broadcast(buffer)
            self.execute(*decode_step(payload, values))
