"""int8 x int8 products of float rows with a fixed weight, each row quantized with its own scale,
for the CPU: what the int8 LM head (quantization.RescoredInt8Head) runs for its whole vocabulary.

A row is divided by its own largest magnitude and quantized to 8 bits, so a row's result never
depends on the other rows of the batch (the int32 sums are exact, the scales per row and per
output channel). Two kernels:

- `OneDNNRowProduct`: oneDNN's int8 linear (`onednn::qlinear_pointwise`, the op inductor lowers
  quantized linears to), unsigned 8-bit activations with zero point 128 (its fast kernels take
  those; signed ones ran a reference kernel, thousands of times slower), dequantized by the kernel.
  On an AMD EPYC (Zen 5) host at one thread it took 0.8x fbgemm's time for Marian's head (58k x
  512) at 32 rows and 0.6x for Gemma 3's (262k x 640) at 16 rows, level at one row
  (`python -m benchmarks.linear_layouts`).
- `FbgemmRowProduct`: PyTorch's dynamic quantized linear (fbgemm), where oneDNN's int8 linear is
  missing or wrong: without VNNI (AVX2 alone) oneDNN's unsigned x signed pair sums saturate at
  16 bits. 7-bit activations would keep them exact there, but at 4x fbgemm's time (a 65k x 640
  head at one thread on an AVX2 EPYC: 19.6 ms against 4.5 ms at one row). It quantizes its
  whole input with one scale, so a fixed row holding +1 and -1 joins the normalized rows and pins
  the input's range to [-1, 1]; it also drops the activations to 7 bits (`reduce_range`), where
  oneDNN keeps 8.
"""

from __future__ import annotations

import functools
import warnings
from typing import Protocol

import torch

QUANTIZED_BLOCK = 1 << 20  # weights per pass (4 MB of float32): in the CPU's caches throughout


class Quantize(Protocol):
    """A float weight [out, in] (its columns first multiplied by `divisor`, when given: the
    input scales of smoothing.py) -> its int8 weight and per-output-channel scales.
    weights_cache.py gives one that reads them from a cache entry."""

    def __call__(
        self, weight: torch.Tensor, divisor: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def quantize_per_channel(
    weight: torch.Tensor, divisor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights [out, in] and their float32 per-output-channel scales, a block
    of rows at a time. Over the whole matrix at once, each op a pass over memory, Gemma 3's LM
    head (262k x 640) took 0.78 s at every start; in blocks 0.11 s (2-core AMD EPYC).
    `divisor` [in]: quantize `weight * divisor` (each column multiplied) instead."""
    weight = weight.detach()
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    step = max(1, QUANTIZED_BLOCK // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        rows = weight[start : start + step].float()
        if divisor is not None:
            rows = rows * divisor.float()
        scale = rows.abs().amax(dim=1).clamp_(min=1e-12).div_(127)
        scales[start : start + step] = scale
        scaled = torch.div(rows, scale[:, None])  # a new block: `weight` stays as it was
        q[start : start + step] = scaled.round_().clamp_(-127, 127)
    return q, scales


class OneDNNRowProduct(torch.nn.Module):
    """`x @ weight.T` of float32 rows x [rows, in] through oneDNN's int8 linear."""

    def __init__(
        self,
        weight: torch.Tensor,
        quantize: Quantize = quantize_per_channel,
    ) -> None:
        super().__init__()
        q, scales = quantize(weight)
        self.packed: torch.Tensor
        self.scales: torch.Tensor
        self.zero_points: torch.Tensor
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(q, None))
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", torch.zeros(q.shape[0], dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)
        q = x.div(magnitude).mul_(127).round_().add_(128).to(torch.uint8)  # 1..255
        out = torch.ops.onednn.qlinear_pointwise(
            q, 1 / 127, 128, self.packed, self.scales, self.zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return out.mul_(magnitude)


class FbgemmRowProduct(torch.nn.Module):
    """`x @ weight.T` of float32 rows x [rows, in] through fbgemm's dynamic quantized linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        out_features, in_features = weight.shape
        plain = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False))
        plain[0].weight = torch.nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        with warnings.catch_warnings():  # torch.ao prints a migration notice (to torchao) on use
            warnings.simplefilter("ignore")
            self.int8 = quantize_dynamic(plain, {torch.nn.Linear: per_channel_dynamic_qconfig})[0]
        pin = torch.zeros(1, in_features)
        pin[0, 0], pin[0, min(1, in_features - 1)] = 1.0, -1.0
        self.range_row: torch.Tensor
        self.register_buffer("range_row", pin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        return self.int8(torch.cat([x / magnitude, self.range_row]))[:-1].mul_(magnitude)


@functools.cache
def onednn_int8_works() -> bool:
    """Whether oneDNN's int8 linear runs in this PyTorch build and gives the right sums (checked
    once on a small product against float32)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.onednn, "qlinear_pointwise"
    ):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 64, generator=generator)
        x = torch.randn(3, 64, generator=generator)
        got = OneDNNRowProduct(weight)(x)
    except (RuntimeError, NotImplementedError):
        return False
    expected = x @ weight.t()
    return bool((got - expected).abs().max() <= 0.05 * expected.abs().max())


def row_product(
    weight: torch.Tensor,
    quantize: Quantize = quantize_per_channel,
) -> torch.nn.Module:
    """The fastest int8 row product of `weight` this build runs (module docstring); `quantize`
    gives oneDNN's its int8 weight (fbgemm's quantizes its own)."""
    return OneDNNRowProduct(weight, quantize) if onednn_int8_works() else FbgemmRowProduct(weight)
