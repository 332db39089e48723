"""Where the model runs and in which number formats, chosen once at start-up.

Torch is imported only when a device or dtype is picked, so the CLI and the config can name the
choices (dtypes here, quantizations here too; quantization.py has their kernels) without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)  # "auto": bfloat16 on CUDA, float32 on the CPU
Quantization = Literal["none", "int8", "int8-weights", "w8a8"]  # see quantization.py
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


def pick_device(name: str = "auto") -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return getattr(torch, name)  # every name but "auto" is a torch dtype's


def quantization_problem(quantization: str, device: torch.device) -> str | None:
    """Why `quantization` cannot run on `device` (None: it can). Checked before anything loads:
    the int8 kernels are CPU GEMMs (quantization.py)."""
    if quantization != "none" and device.type != "cpu":
        return (
            f"quantization {quantization} runs on the CPU only (its int8 kernels are CPU GEMMs); "
            f"on {device.type} serve with quantization none (bfloat16 is the default there)"
        )
    return None


def dtype_warning(model_type: str, dtype: torch.dtype) -> str | None:
    """A dtype known to break a model family: Gemma's activations overflow float16's range."""
    import torch

    if dtype == torch.float16 and model_type.startswith("gemma"):
        return (
            f"{model_type} in float16: Gemma's activations overflow float16 (inf / NaN logits, "
            "garbled text); use bfloat16 (the CUDA default) or float32"
        )
    return None
