"""LoRA adapters' files: peft's `adapter_config.json` and `adapter_model.safetensors` (or `.bin`)
read and checked against the served model, as host tensors with the scaling folded in.

Anything an adapter would compute that this server does not apply (DoRA, trained biases,
embedding or LM-head adapters, fully trained modules, other peft types) is refused with the
reason (`AdapterError`), never served differently: a wrong adapter is a 400 at load time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


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
    return LoRAAdapter(name, path, weights)


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
