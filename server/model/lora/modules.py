"""LoRA adapters over the served model: resident slots on the device, and the delta of every
row's adapter added inside the base model's own linear layers (the files: files.py).

An adapter is a low-rank update `W + (alpha / r) * B @ A` of some of the decoder's projections
(peft's `target_modules`). Rather than merging it into the weights (one adapter per model copy),
each targeted projection is wrapped (`LoRALinear`): it runs the base layer for the whole step, then
adds `B @ (A @ x)` to the rows of each adapter. Adapters live in `max_loras` device slots, stacked
per projection (`LoRAStack`: A as [slots, r_max, in], and B with the scaling folded in), so the
rows of a step may each use a different adapter and the base rows cost nothing. Which slot a row
uses is the engine's business (engine/adapters.py); the step only says it per token (`LoRAStep`).

The delta per projection is one pass over the step: on CUDA one Triton launch pair for all rows
(kernel.py, the punica "bgmv" idea); on the CPU three ops whatever the adapters in the step:
the input times every slot's A at once ([T, slots x r]), masked to each row's own slot, times every
slot's B at once, added into the output. The extra columns are cheap (slots x r is 64 at the
defaults) where a GEMM pair per adapter and its row gathers cost a dispatch each: with four
adapters over 16 rows of the default model, a step took 1.40x the base's that way and 1.22x this
way (benchmarks/lora.py, docs/performance).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from server.model.lora.files import LoRAAdapter, load_adapter
from server.parallel.shard import ShardedModel
from server.step_plan import NO_ADAPTER, AdapterInstall, StepPlan

log = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """Which adapter slot each of a step's packed tokens uses: `slots` [T] int32 (-1: none), and
    for the CPU's path `mask` [T, slots x r_max], 1 where a column of the stacked A matrices is
    the token's own slot's."""

    slots: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def build(
        cls,
        counts: Iterable[tuple[int, int]],
        *,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        masked: bool,
    ) -> LoRAStep | None:
        """From (slot, number of tokens) of each item in packing order; None when every token
        runs the base model."""
        counts = list(counts)
        if all(slot == NO_ADAPTER for slot, _ in counts):  # a step of base rows: nothing to add
            return None
        per_token: list[int] = []
        for slot, count in counts:
            per_token.extend([slot] * count)
        slots = torch.tensor(per_token, dtype=torch.int32)
        mask = None
        if masked:
            column_slot = torch.arange(num_slots * max_rank) // max_rank
            mask = (column_slot[None, :] == slots[:, None]).to(device=device, dtype=dtype)
        return cls(slots.to(device, non_blocking=True), mask)


class LoRAState:
    """The step being run, shared by every wrapped layer (set around each forward)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRAStack:
    """One projection's adapters, all slots: A as [S, r_max, in] and the scaled B, each slot's
    rank padded with zeros to r_max (a slot whose adapter leaves this projection alone is all
    zeros). B is laid out for its path: [S, out, r_max] for the Triton kernel, or as one
    [S x r_max, out] matrix for the CPU's, whose product with the masked [T, S x r_max] shrink adds
    every row's own delta in one GEMM."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        kernel_layout: bool,
    ) -> None:
        self.kernel_layout = kernel_layout
        self.a = torch.zeros(num_slots, max_rank, in_features, device=device, dtype=dtype)
        shape = (
            (num_slots, out_features, max_rank)
            if kernel_layout
            else (num_slots, max_rank, out_features)
        )
        self.b = torch.zeros(*shape, device=device, dtype=dtype)
        self.ranks = [0] * num_slots

    def put(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            self.ranks[slot] = 0
            return
        a, b = weights
        rank = a.shape[0]
        self.a[slot, :rank].copy_(a)
        if self.kernel_layout:
            self.b[slot, :, :rank].copy_(b)
        else:
            self.b[slot, :rank].copy_(b.t())
        self.ranks[slot] = rank

    @property
    def active(self) -> bool:
        return any(self.ranks)

    @property
    def nbytes_per_slot(self) -> int:
        return (self.a[0].nbytes + self.b[0].nbytes) if len(self.ranks) else 0


class LoRALinear(nn.Module):
    """A projection with every row's adapter delta added to the base layer's output."""

    def __init__(self, base: nn.Module, stack: LoRAStack, state: LoRAState, fused: bool) -> None:
        super().__init__()
        self.base = base
        self.stack = stack
        self.state = state
        self.fused = fused  # the Triton kernel (CUDA), else the masked GEMMs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        stack = self.stack
        # traced or captured, every projection adds its delta (zeros where no slot's adapter
        # targets it): `active` reads the slots' ranks, Python ints a trace would specialise on
        # and a capture would freeze, so the trace never reads it (checked first)
        if step is None or not (torch.compiler.is_compiling() or stack.active or capturing()):
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        if self.fused:
            from server.model.lora.kernel import add_lora_delta

            add_lora_delta(flat_x.contiguous(), flat_y, stack.a, stack.b, step.slots)
            return y
        assert step.mask is not None
        a = stack.a.view(-1, stack.a.shape[-1])  # [S x r, in]
        b = stack.b.view(-1, stack.b.shape[-1])  # [S x r, out]
        shrunk = (flat_x.to(a.dtype) @ a.t()).mul_(step.mask)  # each row: its own slot's columns
        if flat_y.dtype == b.dtype:
            flat_y.addmm_(shrunk, b)
        else:
            flat_y += (shrunk @ b).to(flat_y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"slots={len(self.stack.ranks)}, fused={self.fused}"


def capturing() -> bool:
    """Whether this forward is being captured into a CUDA graph (its adapters are filled in
    later, as data to the graph)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def uses_kernel(device: torch.device) -> bool:
    """The Triton kernel on CUDA; the masked GEMMs elsewhere."""
    return device.type == "cuda"


class LoRAModules:
    """The model's targetable projections wrapped, and the device slots their adapters live in."""

    @classmethod
    def wrap(
        cls,
        model: nn.Module,
        targets: dict[str, tuple[int, int]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        shard: ShardedModel | None = None,
    ) -> LoRAModules | None:
        """`model`'s projections wrapped for `num_slots` adapters (None: LoRA off, nothing
        wrapped). The slots live on the model's device. `targets` are the whole model's shapes
        (adapters are checked against them); under tensor parallelism `shard` says which part
        of each projection, and so of each adapter, this rank holds."""
        if not num_slots:
            return None
        device = next(model.parameters()).device
        return cls(
            model,
            targets,
            num_slots=num_slots,
            max_rank=max_rank,
            device=device,
            dtype=dtype,
            shard=shard,
        )

    def __init__(
        self,
        model: nn.Module,
        targets: dict[str, tuple[int, int]],
        *,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        shard: ShardedModel | None = None,
    ) -> None:
        self.targets = targets
        self.shard = shard
        self.state = LoRAState()
        self.num_slots = num_slots
        self.max_rank = max_rank
        fused = uses_kernel(device)
        self.fused = fused
        self.device = device
        self.dtype = dtype
        self.stacks: dict[str, LoRAStack] = {}
        for path, (in_features, out_features) in targets.items():
            if shard is not None:
                in_features, out_features = shard.local_shape(path, in_features, out_features)
            stack = LoRAStack(
                in_features, out_features, num_slots, max_rank, device, dtype, kernel_layout=fused
            )
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), stack, self.state, fused))
            self.stacks[path] = stack
        log.info(
            "LoRA: %d projections adaptable, %d slots of rank <= %d (%.1f MiB per slot)",
            len(targets),
            num_slots,
            max_rank,
            self.bytes_per_slot / 2**20,
        )

    @property
    def bytes_per_slot(self) -> int:
        return sum(stack.nbytes_per_slot for stack in self.stacks.values())

    def install(self, install: AdapterInstall) -> None:
        """Put an adapter's weights in its slot (whatever was there is overwritten); a
        tensor-parallel rank keeps its part of each projection."""
        for path, stack in self.stacks.items():
            weights = install.weights.get(path)
            if weights is not None and self.shard is not None:
                weights = self.shard.shard_adapter(path, *weights)
            stack.put(install.slot, weights)

    @property
    def in_use(self) -> bool:
        """Whether the step being run adds any adapter's delta. A step of base rows runs the
        base model's compiled step and CUDA graphs, traced and captured with no adapter step set:
        `LoRALinear` leaves the base layer's output alone then; a step with an adapter row runs
        the adapter step's graphs (compiled_steps.py, cuda_graphs.py)."""
        return self.state.step is not None

    def read(self, name: str, source: str) -> LoRAAdapter:
        """An adapter's files checked against this model (lora.files.AdapterError when they do
        not fit); any thread."""
        return load_adapter(name, source, self.targets, self.max_rank)

    def example_step(self, tokens: int) -> LoRAStep:
        """A step of `tokens` tokens all on slot 0: what the adapter graphs are traced, checked
        and warmed up with (the weights in the slots are data to them, whatever they hold)."""
        step = LoRAStep.build(
            [(0, tokens)],
            num_slots=self.num_slots,
            max_rank=self.max_rank,
            device=self.device,
            dtype=self.dtype,
            masked=not self.fused,
        )
        assert step is not None
        return step

    def static_step(self, tokens: int) -> LoRAStep:
        """Buffers a captured graph reads each token's adapter from (cuda_graphs.py): every token
        on no adapter until a step's slots (and masks) are copied in."""
        slots = torch.full((tokens,), NO_ADAPTER, dtype=torch.int32, device=self.device)
        columns = self.num_slots * self.max_rank
        mask = None
        if not self.fused:
            mask = torch.zeros(tokens, columns, device=self.device, dtype=self.dtype)
        return LoRAStep(slots, mask)

    @contextlib.contextmanager
    def applied(self, plan: StepPlan) -> Iterator[None]:
        """Each row's adapter (its slot) applied to its tokens during the forward."""
        slots = plan.lora_slots or [NO_ADAPTER] * len(plan.num_new)
        self.state.step = LoRAStep.build(
            zip(slots, plan.num_new),
            num_slots=self.num_slots,
            max_rank=self.max_rank,
            device=self.device,
            dtype=self.dtype,
            masked=not self.fused,
        )
        try:
            yield
        finally:
            self.state.step = None
