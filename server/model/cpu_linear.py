"""Linear layers with their weights stored transposed, for the CPU.

`torch.nn.functional.linear(x, W)` with W stored [out, in] sends MKL down its "NT" sgemm path,
which on this 2-core AVX-512 machine runs a small-batch decode step (M = 1..64 rows) at a third to
a half of the speed of the same product with the weight stored [in, out] ("NN"); with M in the
hundreds (prefill) the two are equal. So on the CPU every linear layer of the decoder, and the LM
head, keeps a contiguous transposed copy and computes `x @ W_t`. Same math, same dtype; only the
summation order inside the GEMM may differ (last-bit rounding). CUDA keeps `nn.Linear`: cuBLAS has
no such gap. Measured by `benchmarks/` (README, Performance).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class TransposedLinear(nn.Module):
    """`nn.Linear` with the weight held as [in_features, out_features], contiguous."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = (
            flat @ self.weight_t
            if self.bias is None
            else torch.addmm(self.bias, flat, self.weight_t)
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def replace_linears(
    module: nn.Module,
    build: Callable[[nn.Linear], nn.Module],
    where: Callable[[str, nn.Linear], bool],
) -> int:
    """Replace every plain `nn.Linear` under `module` for which `where(attribute name, layer)`
    holds by `build(layer)`, in place; returns the count. Each replaced layer's weight is released
    as it goes."""
    targets = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and where(name, child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, build(child))
    return len(targets)


def transpose_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a TransposedLinear; returns the count."""
    return replace_linears(module, TransposedLinear.from_linear, lambda _name, _layer: True)
