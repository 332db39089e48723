"""`python -m benchmarks.linear_layouts`: one linear layer in each CPU weight layout, timed.

The layouts of `server/model/cpu_linear.py` side by side in one process, on a random fp32 weight
of the given shape (default: Gemma 3 270M's LM head, 262144 x 640) at several row counts: MKL with
the weight as loaded (`nn.Linear`), MKL with it transposed, and oneDNN with it prepacked (fp32 and
bf16); then the int8 LM head of `server/model/quantization.py` (an int8 GEMM, each row quantized
on its own, then each row's top 64 re-scored exactly), its int8 GEMM alone in both kernels of
`server/model/int8_products.py` (oneDNN's int8 linear with 8-bit rows, fbgemm's dynamic linear
with 7-bit ones), and the same GEMM as `torch._int_mm` (int8 x int8 with per-token scales).
Prints the best of `--repeats` calls per cell, in milliseconds, and the oneDNN speed-up over the
better MKL layout.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from server.model.cpu_linear import OneDNNLinear, onednn_available
from server.model.int8_products import FbgemmRowProduct, OneDNNRowProduct, onednn_int8_works
from server.model.quantization import Int8DynamicLinear, RescoredInt8Head


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@torch.inference_mode()
def time_layouts(
    out_features: int, in_features: int, rows: list[int], repeats: int
) -> dict[str, list[float]]:
    """Milliseconds per call of each layout at each row count."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    transposed = linear.weight.detach().t().contiguous()
    layouts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "MKL native (nn.Linear)": linear,
        "MKL transposed": lambda x: x @ transposed,
    }
    if onednn_available():
        layouts["oneDNN prepacked"] = OneDNNLinear.from_linear(linear)
    if onednn_available(torch.bfloat16):
        bf16 = OneDNNLinear.from_linear(
            nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
        )
        layouts["oneDNN prepacked bf16"] = lambda x: bf16(x.to(torch.bfloat16))
    head = RescoredInt8Head(linear.weight)
    layouts["int8 head, top 64 re-scored"] = head
    if onednn_int8_works():
        layouts["int8 GEMM, oneDNN"] = OneDNNRowProduct(linear.weight)
    layouts["int8 GEMM, fbgemm"] = FbgemmRowProduct(linear.weight)
    layouts["torch._int_mm, per-token"] = Int8DynamicLinear(linear.weight, None)
    table: dict[str, list[float]] = {name: [] for name in layouts}
    for count in rows:
        x = torch.randn(count, in_features)
        for name, layer in layouts.items():
            table[name].append(best_ms(lambda layer=layer, x=x: layer(x), repeats))  # type: ignore[misc]
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_layouts", description=__doc__)
    p.add_argument("--out-features", type=int, default=262144)
    p.add_argument("--in-features", type=int, default=640)
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    table = time_layouts(args.out_features, args.in_features, rows, args.repeats)
    print(f"{args.out_features} x {args.in_features} fp32, {torch.get_num_threads()} threads, ms")
    print(f"{'layout':30}" + "".join(f"{r:>9} rows" for r in rows))
    for name, times in table.items():
        print(f"{name:30}" + "".join(f"{t:14.1f}" for t in times))
    if "oneDNN prepacked" in table:
        mkl = [min(a, b) for a, b in zip(*list(table.values())[:2])]
        ratios = [m / o for m, o in zip(mkl, table["oneDNN prepacked"])]
        print(f"{'oneDNN speed-up':30}" + "".join(f"{r:13.2f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
