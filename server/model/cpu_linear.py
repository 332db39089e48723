"""Linear layers for the CPU: oneDNN's prepacked weights (OneDNNLinear), or weights stored
transposed (and the LM head in both layouts, chosen per call from start-up timings:
MeasuredLayoutLinear).

oneDNN (`torch.ops.mkldnn`, what inductor's CPU freezing uses) packs the weight once into its
blocked layout; each call then streams it once, whatever the row count. MKL's sgemm re-packs the
weight inside every call, which at 2-16 rows (decode batches, speculative verification) costs
more than the product: on an AMD Zen 4 host the Gemma 3 LM head (262k x 640, fp32) took 132 ms at
16 rows through MKL and 35 ms through oneDNN, and a whole 16-row decode step went from 258 to
131 ms. Which is faster is still timed at start-up (`onednn_is_faster`), since hosts differ.

`torch.nn.functional.linear(x, W)` with W stored [out, in] sends MKL down its "NT" sgemm path,
which on this 2-core AVX-512 machine runs a small-batch decode step (M = 1..64 rows) at a third to
a half of the speed of the same product with the weight stored [in, out] ("NN"); with M in the
hundreds (prefill) the two are equal. So on the CPU every linear layer of the decoder, and the LM
head, keeps a contiguous transposed copy and computes `x @ W_t`. Same math, same dtype; only the
summation order inside the GEMM may differ (last-bit rounding). CUDA keeps `nn.Linear`: cuBLAS has
no such gap. Measured by `benchmarks/` (docs/performance).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN linear for weights of `dtype` in this build on this CPU (float32; bfloat16 where
    the CPU has it; not float16)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class OneDNNLinear(nn.Module):
    """`nn.Linear` through oneDNN with the weight prepacked for it (a copy in oneDNN's layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> OneDNNLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


@torch.inference_mode()
def onednn_is_faster(
    linear: nn.Linear, onednn: OneDNNLinear, rows: tuple[int, ...] = (1, 16), repeats: int = 3
) -> bool:
    """Whether `onednn`, over calls of each row count, takes less time than the better of the
    two plain layouts of `linear` (best of `repeats` calls each, timed here)."""
    transposed = linear.weight.detach().t().contiguous()
    packed = plain = 0.0
    for count in rows:
        x = torch.randn(count, linear.in_features, dtype=linear.weight.dtype)

        def best(fn: Callable[[], object]) -> float:
            return min(_seconds(fn) for _ in range(repeats))

        packed += best(lambda x=x: onednn(x))  # type: ignore[misc]
        plain += min(best(lambda x=x: linear(x)), best(lambda x=x: x @ transposed))  # type: ignore[misc]
    return packed < plain


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


def onednn_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a OneDNNLinear; returns the count."""
    return replace_linears(module, OneDNNLinear.from_linear, lambda _name, _layer: True)


LAYOUTS = ("auto", "onednn", "measured", "transposed", "native")


def apply_linear_layout(
    decoder: nn.Module, head: nn.Module, layout: str, device: torch.device, compiled: bool = False
) -> tuple[nn.Module, str]:
    """Put the decoder's plain linear layers, and the LM head if it is a plain `nn.Linear`, in
    `layout`; returns the head to use and the layout taken. measured: the decoder transposed and
    the head in both layouts (MeasuredLayoutLinear). auto: native on CUDA; on the CPU oneDNN
    where it is timed faster than the better plain layout here (on the head, or the decoder's first
    linear when the head is quantized), else measured. A tied head's copy leaves the embedding
    its own table.
    `compiled` (torch.compile of the decoder): inductor lowers oneDNN linears only for weights
    frozen into its graph, which ours are not, so auto does not take oneDNN then."""
    if layout not in LAYOUTS:
        raise ValueError(f"linear_layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if device.type != "cpu":
        if layout in ("onednn", "measured", "transposed"):
            raise ValueError(f"linear_layout {layout} is for the CPU; use auto or native")
        return head, "native"
    plain_head = type(head) is nn.Linear
    onednn_head = None
    if layout == "auto":
        probe = (
            head
            if plain_head
            else next((m for m in decoder.modules() if type(m) is nn.Linear), None)
        )
        layout = "measured"
        if isinstance(probe, nn.Linear) and onednn_available(probe.weight.dtype) and not compiled:
            candidate = OneDNNLinear.from_linear(probe)
            if onednn_is_faster(probe, candidate):
                layout, onednn_head = "onednn", candidate if plain_head else None
    if layout == "native":
        return head, layout
    if layout == "onednn":
        if compiled:
            raise ValueError("linear_layout onednn does not compile: use auto with torch_compile")
        dtype = next((p.dtype for p in decoder.parameters() if p.is_floating_point()), None)
        if not onednn_available(dtype or torch.float32):
            raise ValueError(
                f"linear_layout onednn needs a PyTorch build with oneDNN (mkldnn) and {dtype} "
                "support for it on this CPU; use auto"
            )
        onednn_linears(decoder)
        if plain_head:
            head = onednn_head or OneDNNLinear.from_linear(head)  # type: ignore[arg-type]
        return head, layout
    transpose_linears(decoder)
    if plain_head:
        head = (
            TransposedLinear.from_linear(head)  # type: ignore[arg-type]
            if layout == "transposed"
            else MeasuredLayoutLinear(head)  # type: ignore[arg-type]
        )
    return head, layout
