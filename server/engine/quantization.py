"""Opt-in weight formats for the CPU, the largest CPU lever measured here (see README, Performance).

`int8` quantizes the LM head only: an untied copy of it with int8 weights and per-output-channel
scales, run with PyTorch's dynamic quantized kernels (activations quantized on the fly). With
Gemma's 262k-token vocabulary the head is most of a CPU step. Quantizing the 18 decoder layers the
same way was measured too and nearly doubled Gemma 3 270M's perplexity on the bundled text
(32.0 -> 54), while the int8 head alone moves it to 32.4; so the body keeps its dtype (combine with
`--dtype bfloat16` for a faster body: 32.1). `benchmarks/accuracy.py` reports perplexity and greedy
agreement against fp32. CPU only: the dynamic quantized kernels are CPU kernels.
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")


def quantized_lm_head(head: torch.nn.Module, device: torch.device, method: str) -> torch.nn.Module:
    """The LM head to run: `head` itself, or an int8 copy of it (which takes float32 inputs)."""
    if method == "none":
        return head
    if method != "int8":
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on the CPU only; use --dtype bfloat16 on CUDA")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    weight = head.weight.detach().float()
    untied = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    untied[0].weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    with warnings.catch_warnings():  # torch.ao prints a migration notice (to torchao) on use
        warnings.simplefilter("ignore")
        quantized = quantize_dynamic(untied, {torch.nn.Linear: per_channel_dynamic_qconfig})
    log.info("LM head quantized: int8 weights, per-channel scales (%d x %d)", *weight.shape)
    return quantized[0]
