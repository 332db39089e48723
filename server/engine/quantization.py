"""Opt-in weight formats for the CPU, the largest CPU lever measured here (see README, Performance).

`int8`: dynamic int8 quantization of every nn.Linear (weights int8 per tensor, activations
quantized on the fly), LM head included, which unties it from the fp32 embedding. It changes the
numbers, so it is never the default: `benchmarks/accuracy.py` reports perplexity and greedy
agreement against fp32 beside its speed. CPU only (PyTorch's dynamic quantized kernels are CPU
kernels); on CUDA use `--dtype bfloat16` instead.
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")


def quantize(model: torch.nn.Module, method: str, device: torch.device) -> torch.nn.Module:
    if method == "none":
        return model
    if method != "int8":
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on the CPU only; use --dtype bfloat16 on CUDA")
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch.ao prints a migration notice (to torchao) on import/use
        warnings.simplefilter("ignore")
        model = quantize_dynamic(model.float(), {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    log.info("weights quantized: dynamic int8 for every Linear layer")
    return model
