"""LoRA adapters made with peft for the tests: random, non-zero A and B (peft's
`init_lora_weights=False`), saved in peft's format; the same base with the adapter merged is the
reference the server's outputs must equal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    targets: list[str] | None = None,
    seed: int = 0,
    scale: float = 1.0,
    **config: Any,
) -> Path:
    """Save an adapter of `base_dir` in `out_dir`; `scale` multiplies its B matrices (peft's
    random init is small next to a tiny model's weights: scaled up, its outputs differ)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=r,
        lora_alpha=config.pop("lora_alpha", 2 * r),
        target_modules=targets or ["q_proj", "v_proj"],
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(base, lora)
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """The base with the adapter merged into its weights (peft's merge_and_unload)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def edit_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
