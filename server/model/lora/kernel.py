"""Batched multi-LoRA deltas as two Triton kernels (punica's "bgmv" idea): one launch pair per
projection serves every token of a step, whatever adapter each token's request uses.

A step mixes requests on different adapters and on none. Gathering each token's A and B matrices
into a batch ([T, R, in] and [T, out, R]) costs T copies of the adapter weights per layer, and
looping over the adapters in Python costs a launch (and a host sync to find the rows) per adapter.
Here every program reads its token's slot and streams that slot's weights itself; tokens on the
same adapter hit the same weights in L2, and rows on no adapter (slot -1, the base model's
requests) return at once, so they cost a program start and nothing else.

- "shrink": x [T, in] -> mid [T, R] (float32), mid[t] = A[slot] @ x[t]; a program takes one row
  and the (whole, R <= 64) rank block, and walks `in` in blocks of `BLOCK_K` features.
- "expand": out[t] += B[slot] @ mid[t]; a program takes one row and `BLOCK_N` output features,
  and walks the rank in blocks of `BLOCK_R`.

Products are elementwise multiply + row sums in float32 (a token row is a matrix-vector product:
tensor cores would need 16 rows), so no `tl.dot` runs here (the interpreter's bf16 / fp16
`tl.dot` is wrong, see triton_attention.py). The intermediate stays in float32 and the delta is
added to `out` in float32 before the one rounding to its dtype. Block sizes are powers of two
from a register budget (`launch_config`); masks make any feature count and rank work.

Compile-time constants are the dtype, the rank (B's rows are then of a known, vectorisable
stride) and the block sizes; the feature counts and strides are runtime ints (Triton specialises
them on divisibility by 16, a per-layer constant), the number of tokens only sizes the grid, and
the slots tensor is not specialised on alignment (one scalar load, and it may be a view at any
offset), so after a step on each layer a server compiles no variant mid-serving, and the variants
are few (one shrink and one expand per dtype, rank and feature block).
tests/test_triton_lora.py compiles every launch serving can make for sm_90 and sm_80 offline and
checks for spills; the interpreter runs code the compiler would refuse.

Runs on CUDA; `TRITON_INTERPRET=1` (set before this module is imported) runs the same kernels on
CPU tensors, which is how CI tests them. `lora_delta_reference` is the same computation in torch
(the CPU path without the interpreter, and the tests' reference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Register budget of one program's weight tile, in elements (4 warps: 64 float32 values a thread).
# Chosen with ptxas's reports for sm_90 / sm_80; tests/test_triton_lora.py holds it to no spills.
TILE_ELEMENTS = 8192
# The expand's per-feature vectors (accumulator, `out` pointers and values, masks) grow with its
# feature block too: at 1024 features (rank 8) ptxas needed 255 registers and spilled.
MAX_BLOCK_N = 512
NUM_WARPS = 4
MAX_RANK = 64


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    mid_ptr,
    slots_ptr,
    in_features,
    stride_xt,
    stride_as,
    stride_ar,
    stride_mt,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """mid[t, r] = sum_k A[slot(t), r, k] * x[t, k] for this program's row t and rank block."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[:, None] * stride_ar
    acc = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, in_features, BLOCK_K):
        kk = start + k
        k_ok = kk < in_features
        xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    tl.store(mid_ptr + t.to(tl.int64) * stride_mt + r, acc, mask=r_ok)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _lora_expand_kernel(
    mid_ptr,
    b_ptr,
    out_ptr,
    slots_ptr,
    out_features,
    stride_mt,
    stride_bs,
    stride_ot,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[t, n] += sum_r B[slot(t), n, r] * mid[t, r] for this program's row t and block of n."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    r = tl.arange(0, BLOCK_R)
    mid_row = mid_ptr + t.to(tl.int64) * stride_mt
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + n[:, None] * RANK  # B[slot] rows: unit stride
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, RANK, BLOCK_R):
        rr = start + r
        r_ok = rr < RANK
        m = tl.load(mid_row + rr, mask=r_ok, other=0.0)
        b = tl.load(b_rows + rr[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * m[None, :], axis=1)
    out_row = out_ptr + t.to(tl.int64) * stride_ot + n
    base = tl.load(out_row, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_row, (base + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class LoraLaunch:
    """Block sizes of the two kernels for one (in, out, rank) shape."""

    block_r: int  # rank block: the whole (padded) rank, <= MAX_RANK
    block_k: int  # shrink: input features per step of its loop
    block_n: int  # expand: output features per program
    num_warps: int


def launch_config(in_features: int, out_features: int, rank: int) -> LoraLaunch:
    """Power-of-two blocks whose weight tile (rank block x feature block) fits TILE_ELEMENTS, no
    wider than the (padded) feature count so small layers waste no lanes."""
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"LoRA rank must be 1..{MAX_RANK}, got {rank}")
    block_r = triton.next_power_of_2(rank)
    feature_block = TILE_ELEMENTS // block_r
    block_k = min(feature_block, max(16, triton.next_power_of_2(in_features)))
    block_n = min(feature_block, MAX_BLOCK_N, max(16, triton.next_power_of_2(out_features)))
    return LoraLaunch(block_r, block_k, block_n, NUM_WARPS)


def _check(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[int, int, int]:
    """(in_features, out_features, rank), after checking the shapes agree (no device sync)."""
    if x.dim() != 2 or out.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("x, out: [T, features]; lora_a: [S, R, in]; lora_b: [S, out, R]")
    tokens, in_features = x.shape
    num_slots, rank, a_in = lora_a.shape
    b_slots, out_features, b_rank = lora_b.shape
    if (
        out.shape[0] != tokens
        or out.shape[1] != out_features
        or a_in != in_features
        or b_rank != rank
        or b_slots != num_slots
        or slots.shape != (tokens,)
    ):
        raise ValueError(
            f"LoRA shapes disagree: x {tuple(x.shape)}, out {tuple(out.shape)}, "
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, "
            f"slots {tuple(slots.shape)}"
        )
    if out.dtype != x.dtype:
        raise ValueError(f"out is {out.dtype}, x is {x.dtype}")
    return in_features, out_features, rank


def add_lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """out[t] += lora_b[slots[t]] @ (lora_a[slots[t]] @ x[t]) for every t with slots[t] >= 0.

    x [T, in] and out [T, out] (same dtype, unit last stride, rows 16-byte aligned), lora_a
    [S, R, in], lora_b [S, out, R] (the scaling folded in; rank padded with zeros), slots [T]
    int32 on x's device (-1: no adapter, the row is left as it is). `out` is updated in place.
    """
    in_features, out_features, rank = _check(x, out, lora_a, lora_b, slots)
    if x.device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "add_lora_delta runs on CUDA (or TRITON_INTERPRET=1); on the CPU use "
            "lora_delta_reference"
        )
    tokens = x.shape[0]
    if tokens == 0 or out_features == 0:
        return
    for name, t in (("x", x), ("out", out), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride")
    if lora_b.stride(1) != rank:
        raise ValueError("lora_b's slots need contiguous [out, R] matrices")
    launch = launch_config(in_features, out_features, rank)
    mid = torch.empty((tokens, rank), dtype=torch.float32, device=x.device)
    _lora_shrink_kernel[(tokens, triton.cdiv(rank, launch.block_r))](
        x,
        lora_a,
        mid,
        slots,
        in_features,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        mid.stride(0),
        RANK=rank,
        BLOCK_R=launch.block_r,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
    )
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, launch.block_n))](
        mid,
        lora_b,
        out,
        slots,
        out_features,
        mid.stride(0),
        lora_b.stride(0),
        out.stride(0),
        RANK=rank,
        BLOCK_N=launch.block_n,
        BLOCK_R=launch.block_r,
        num_warps=launch.num_warps,
    )


def lora_delta_reference(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`add_lora_delta` in torch, in place: per adapter slot present, its rows' delta in float32
    added to `out` in float32, then rounded once to out's dtype. Syncs with the device (it finds
    the slots present), so it is the CPU path and the tests' reference."""
    _check(x, out, lora_a, lora_b, slots)
    slots = slots.long()
    for slot in torch.unique(slots[slots >= 0]).tolist():
        rows = (slots == slot).nonzero().squeeze(1)
        mid = x[rows].float() @ lora_a[slot].float().T
        delta = mid @ lora_b[slot].float().T
        out[rows] = (out[rows].float() + delta).to(out.dtype)
