"""Where the model runs and in which number formats, chosen once at start-up.

Torch is imported only when a device or dtype is picked, so the CLI and the config can name the
choices (dtypes here, quantizations here too; quantization.py has their kernels) without it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)  # "auto": bfloat16 on CUDA, float32 on the CPU
# see quantization.py; "auto" is resolved at start-up (resolve_quantization)
Quantization = Literal["auto", "none", "int8", "int8-weights", "w8a8", "w8a8-all"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# CPU flags (Linux /proc/cpuinfo names) of native int8 dot products, which w8a8's GEMMs run on
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def resolve_quantization(quantization: str, dtype: str, device: torch.device) -> str:
    """`auto`: w8a8 on a CPU with native int8 dot products (VNNI, AMX) when the dtype is left at
    auto too, else none. An explicit dtype asks for that precision: `--dtype float32` is the
    exact mode. Other values are returned as given."""
    if quantization != "auto":
        return quantization
    fast = device.type == "cpu" and dtype == "auto" and bool(cpu_flags() & INT8_DOT_FLAGS)
    return "w8a8" if fast else "none"


def resolve_torch_compile(
    torch_compile: bool | None, quantization: str, resolved: str, device: torch.device
) -> bool:
    """Empty (None): compile the decode step where `quantization` auto chose w8a8 (the fast CPU
    default; its compiled step is 1.3-1.5x the eager one's output tok/s) and inductor has a C++
    compiler; a machine without one gets the fastest path that needs none. A given value wins."""
    if torch_compile is not None:
        return torch_compile
    return quantization == "auto" and resolved == "w8a8" and compiler_available(device)


def quantization_problem(quantization: str, device: torch.device) -> str | None:
    """Why `quantization` cannot run on `device` (None: it can). Checked before anything loads:
    the int8 kernels are CPU GEMMs (quantization.py)."""
    if quantization not in ("none", "auto") and device.type != "cpu":
        return (
            f"quantization {quantization} runs on the CPU only (its int8 kernels are CPU GEMMs); "
            f"on {device.type} serve with quantization none (bfloat16 is the default there)"
        )
    return None


def check_runner_options(compile_decode: bool, quantization: str, device: torch.device) -> None:
    """ValueError when torch_compile or the quantization cannot run on `device`."""
    if compile_decode and not compiler_available(device):
        raise ValueError(
            "torch_compile needs a C/C++ compiler on PATH (inductor builds its kernels with "
            "it): install g++ (CPU) or gcc (CUDA, for Triton), or run without --torch-compile"
        )
    if (problem := quantization_problem(quantization, device)) is not None:
        raise ValueError(problem)


def dtype_warning(model_type: str, dtype: torch.dtype) -> str | None:
    """A dtype known to break a model family: Gemma's activations overflow float16's range."""
    import torch

    if dtype == torch.float16 and model_type.startswith("gemma"):
        return (
            f"{model_type} in float16: Gemma's activations overflow float16 (inf / NaN logits, "
            "garbled text); use bfloat16 (the CUDA default) or float32"
        )
    return None


def compiler_available(device: torch.device) -> bool:
    """Inductor compiles its CPU kernels with a C++ compiler; Triton (CUDA) builds its launchers
    with a C one."""
    names = ("g++", "c++", "clang++") if device.type == "cpu" else ("gcc", "cc", "clang")
    chosen = os.environ.get("CXX" if device.type == "cpu" else "CC")
    return any(shutil.which(name) for name in ((chosen,) if chosen else ()) + names)


def pick_attention_backend(name: str, device: torch.device, compile_decode: bool) -> str:
    """auto: the paged-attention kernel on CUDA (gather with torch_compile, which inductor
    traces), the gather path on the CPU (faster there: see docs/guides/tuning.md)."""
    available = importlib.util.find_spec("triton") is not None
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if name == "auto":
        return "triton" if device.type == "cuda" and available and not compile_decode else "gather"
    if name == "triton":
        if not available:
            raise ValueError("attention_backend triton needs the triton package")
        if device.type != "cuda" and not interpret:
            raise ValueError(
                "attention_backend triton runs on CUDA (on the CPU only under TRITON_INTERPRET=1, "
                "for tests); use gather"
            )
        if compile_decode:
            raise ValueError("torch_compile runs the gather path: use attention_backend gather")
    elif name != "gather":
        raise ValueError(f"attention_backend must be auto, gather or triton; got {name!r}")
    return name
