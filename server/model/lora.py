"""LoRA adapters over the served model: peft's files read and checked, resident slots on the
device, and the delta of every row's adapter added inside the base model's own linear layers.

An adapter is a low-rank update `W + (alpha / r) * B @ A` of some of the decoder's projections
(peft's `target_modules`). Rather than merging it into the weights (one adapter per model copy),
each targeted projection is wrapped (`LoRALinear`): it runs the base layer for the whole step, then
adds `B @ (A @ x)` to the rows of each adapter. Adapters live in `max_loras` device slots, stacked
per projection (`LoRAStack`: A as [slots, r_max, in], B as [slots, out, r_max] with the scaling
folded in), so the rows of a step may each use a different adapter and the base rows cost
nothing. Which slot a row uses is the engine's business (engine/adapters.py); the step only says
it per token (`LoRAStep`).

The delta per projection is one pass over the step: on CUDA one Triton launch pair for all rows
(triton_lora.py, the punica "bgmv" idea); on the CPU three ops whatever the adapters in the step:
the input times every slot's A at once ([T, slots x r]), masked to each row's own slot, times every
slot's B at once, added into the output. The extra columns are cheap (slots x r is 64 at the
defaults) where a GEMM pair per adapter and its row gathers cost a dispatch each: with four
adapters over 16 rows of the default model, a step took 1.40x the base's that way and 1.22x this
way (benchmarks/lora.py, docs/performance).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# The decoder projections an adapter may target: attention and MLP, as peft names them for the
# Llama-style models served here. Embeddings and the LM head are not adapted.
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NO_ADAPTER = -1  # a row's slot when it runs the base model
_PEFT_PREFIX = "base_model.model."
# peft config fields that change what an adapter computes and that this runtime does not apply:
# set to anything but their default, the adapter is refused rather than served differently.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "Conv1D-layout weights (fan_in_fan_out)",
    "lora_bias": "LoRA biases (lora_bias)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "target_parameters": "parameter targets (target_parameters)",
    "layer_replication": "layer replication (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}


class AdapterError(ValueError):
    """An adapter that cannot be served over this model; the message says why."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights on the host, checked against the model: for each targeted module
    (its path in the model), A [r, in] and B [out, r] with the scaling folded into B."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def target_modules(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target, by its path in `model`: (in, out) features.
    Read before any quantization replaces the layers."""
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_NAMES
    }


def read_adapter(
    name: str, path: Path, targets: dict[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """peft's `adapter_config.json` and `adapter_model.safetensors` (or `.bin`) in `path`,
    checked against the model's `targets`; AdapterError says what does not fit."""
    config_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"adapter {name!r}: {path} is not a directory")
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json (peft's format)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: unreadable adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    _check_config(name, config)
    tensors = _read_weights(name, path)
    pairs = _pair_weights(name, tensors)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in sorted(pairs.items()):
        if module not in targets:
            short = module.rsplit(".", 1)[-1]
            what = (
                f"the model has no module {module!r}"
                if short in TARGET_NAMES
                else f"{short!r} is not a projection adapters may target here "
                f"({', '.join(TARGET_NAMES)})"
            )
            raise AdapterError(f"adapter {name!r} targets {module}: {what}")
        in_features, out_features = targets[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise AdapterError(
                f"adapter {name!r}: {module}'s lora_A / lora_B are not [r, in] / [out, r]"
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise AdapterError(
                f"adapter {name!r} was not trained on this model: {module} is {in_features} -> "
                f"{out_features} here, the adapter's is {a.shape[1]} -> {b.shape[0]}"
            )
        if rank > max_rank:
            raise AdapterError(
                f"adapter {name!r} has rank {rank} at {module}, above max_lora_rank {max_rank}"
            )
        scale = _scaling(config, module, rank)
        weights[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
    if not weights:
        raise AdapterError(f"adapter {name!r}: its weights file holds no LoRA weights")
    return LoRAAdapter(name, path, max(a.shape[0] for a, _ in weights.values()), weights)


def _check_config(name: str, config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name!r} is a {peft_type} adapter; only LoRA is served")
    for key, what in _UNSUPPORTED.items():
        value = config.get(key)
        if value not in (None, False, [], {}, "", "none"):
            raise AdapterError(f"adapter {name!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter {name!r} trains biases (bias={config['bias']!r}), which is not supported"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key, 8)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise AdapterError(f"adapter {name!r}: {key} must be a positive number, got {value!r}")


def _read_weights(name: str, path: Path) -> dict[str, torch.Tensor]:
    safetensors_file = path / "adapter_model.safetensors"
    bin_file = path / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_file))
        if bin_file.is_file():
            loaded = torch.load(bin_file, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise AdapterError(f"adapter {name!r}: adapter_model.bin is not a state dict")
            return loaded
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file: say which, never a 500
        raise AdapterError(f"adapter {name!r}: unreadable weights in {path}: {exc}") from None
    raise AdapterError(
        f"adapter {name!r}: {path} has neither adapter_model.safetensors nor adapter_model.bin"
    )


def _pair_weights(
    name: str, tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A, B)} from peft's saved keys (`base_model.model.<path>.lora_A.weight`)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise AdapterError(
                f"adapter {name!r}: weight {key!r} is not a LoRA A / B matrix of a linear layer "
                "(embedding adapters, DoRA magnitudes and saved modules are not supported)"
            )
    pairs = {}
    for module, parts in halves.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {name!r}: {module} lacks its lora_A or lora_B weight")
        pairs[module] = (parts["lora_A"], parts["lora_B"])
    return pairs


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """peft's scaling of `module`: lora_alpha / r (or / sqrt(r) with rsLoRA), where alpha may
    come from `alpha_pattern` (r is the saved weights' own)."""
    alpha = float(config.get("lora_alpha", 8))
    patterns = config.get("alpha_pattern") or {}
    if patterns:
        from peft.utils.other import get_pattern_key

        key = get_pattern_key(list(patterns), module)
        alpha = float(patterns.get(key, alpha))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


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
        per_token: list[int] = []
        for slot, count in counts:
            per_token.extend([slot] * count)
        if all(slot == NO_ADAPTER for slot in per_token):
            return None
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
        if step is None or not stack.active:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        if self.fused:
            from server.model.triton_lora import add_lora_delta

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


def uses_kernel(device: torch.device) -> bool:
    """The Triton kernel on CUDA; the masked GEMMs elsewhere."""
    return device.type == "cuda"


class LoRAModules:
    """The model's targetable projections wrapped, and the device slots their adapters live in."""

    def __init__(
        self,
        model: nn.Module,
        targets: dict[str, tuple[int, int]],
        *,
        num_slots: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.targets = targets
        self.state = LoRAState()
        self.num_slots = num_slots
        self.max_rank = max_rank
        fused = uses_kernel(device)
        self.fused = fused
        self.dtype = dtype
        self.stacks: dict[str, LoRAStack] = {}
        for path, (in_features, out_features) in targets.items():
            stack = LoRAStack(
                in_features, out_features, num_slots, max_rank, device, dtype, kernel_layout=fused
            )
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(parent, attr, LoRALinear(getattr(parent, attr), stack, self.state, fused))
            self.stacks[path] = stack
        self.resident: list[str | None] = [None] * num_slots  # adapter name per slot, for logs
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

    def install(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (whatever was there is overwritten)."""
        for path, stack in self.stacks.items():
            stack.put(slot, adapter.weights.get(path))
        self.resident[slot] = adapter.name

    def begin(self, counts: Sequence[tuple[int, int]], device: torch.device) -> None:
        """The next forward's tokens: (slot, number of tokens) per item, in packing order."""
        self.state.step = LoRAStep.build(
            counts,
            num_slots=self.num_slots,
            max_rank=self.max_rank,
            device=device,
            dtype=self.dtype,
            masked=not self.fused,
        )

    def end(self) -> None:
        self.state.step = None


def load_adapter(
    name: str, source: str, targets: dict[str, tuple[int, int]], max_rank: int
) -> LoRAAdapter:
    """`source` (a local directory, else a hub id resolved like `--model`) read and checked."""
    from server.model.hub import ModelNotFound, fetch_hub_adapter, parse_hub_id

    path = Path(source).expanduser()
    if not path.exists():
        hub = parse_hub_id(source)
        if hub is None or hub.file is not None:
            raise AdapterError(
                f"adapter {name!r}: {source!r} is neither a local directory nor a hub id (org/name)"
            )
        try:
            path = fetch_hub_adapter(hub.repo_id)
        except ModelNotFound as exc:
            raise AdapterError(str(exc)) from None
    return read_adapter(name, path, targets, max_rank)
