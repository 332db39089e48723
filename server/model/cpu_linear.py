"""Linear layers with their weights stored transposed, for the CPU (and the LM head in both
layouts, chosen per call from start-up timings: MeasuredLayoutLinear).

`torch.nn.functional.linear(x, W)` with W stored [out, in] sends MKL down its "NT" sgemm path,
which on this 2-core AVX-512 machine runs a small-batch decode step (M = 1..64 rows) at a third to
a half of the speed of the same product with the weight stored [in, out] ("NN"); with M in the
hundreds (prefill) the two are equal. So on the CPU every linear layer of the decoder, and the LM
head, keeps a contiguous transposed copy and computes `x @ W_t`. Same math, same dtype; only the
summation order inside the GEMM may differ (last-bit rounding). CUDA keeps `nn.Linear`: cuBLAS has
no such gap. Measured by `benchmarks/` (README, Performance).
"""

from __future__ import annotations

import time
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


ROW_BUCKETS = (1, 4, 16, 64)  # rows per call the head's two layouts are timed at


def row_bucket(rows: int) -> int:
    """The largest timed row count <= rows (calls are decided by the nearest timing below)."""
    return max((b for b in ROW_BUCKETS if b <= rows), default=ROW_BUCKETS[0])


def _seconds(fn: Callable[[], object]) -> float:
    fn()  # first call: allocation, kernel choice
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class MeasuredLayoutLinear(nn.Module):
    """A linear layer holding its weight in both layouts, each call using the one that was faster
    for that many rows when timed at start-up (on this machine).

    Which layout a CPU's GEMM library prefers depends on the CPU and the row count: the LM head
    of Gemma 3 (262k x 640, fp32) on an AMD Zen 4 host took 60 ms native and 34 ms transposed at
    one row but 143 and 200 ms at 16 rows, while Intel hosts favoured the transposed layout at
    every small batch. The head is most of a CPU decode step, so it is timed rather than assumed.
    The native weight is the layer's own (for a tied head, the embedding table, which stays
    anyway); the transposed copy is what TransposedLinear would hold."""

    def __init__(self, linear: nn.Linear, transposed_buckets: frozenset[int] | None = None):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.transposed_buckets = (
            self.measure() if transposed_buckets is None else transposed_buckets
        )

    @torch.inference_mode()
    def measure(self, margin: float = 0.9) -> frozenset[int]:
        """Row buckets at which the transposed layout took under `margin` x the native time."""
        faster = set()
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, self.in_features, dtype=self.weight.dtype)
            native = _seconds(lambda x=x: self._native(x))  # type: ignore[misc]
            transposed = _seconds(lambda x=x: self._transposed(x))  # type: ignore[misc]
            if transposed < margin * native:
                faster.add(rows)
        return frozenset(faster)

    def _native(self, flat: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(flat, self.weight, self.bias)

    def _transposed(self, flat: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return flat @ self.weight_t
        return torch.addmm(self.bias, flat, self.weight_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if row_bucket(flat.shape[0]) in self.transposed_buckets:
            out = self._transposed(flat)
        else:
            out = self._native(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        buckets = sorted(self.transposed_buckets)
        return f"in={self.in_features}, out={self.out_features}, transposed at rows {buckets}"


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
