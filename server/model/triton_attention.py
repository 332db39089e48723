"""Paged attention as one Triton kernel: keys and values are read through the block table inside
the kernel, so no step materialises a row's gathered history (the gather + SDPA path in
attention.py does, once per layer per step).

One launch per layer serves the whole step: prefill / extend chunks and decode rows alike. The
packed queries are cut into tiles of up to `block_q` tokens of one sequence (`PagedStep`); a
program takes `SUB_Q` queries of one tile and one KV head, with that head's whole GQA group of
query heads stacked in its rows, so each key and value block is loaded once per group. It walks
the sequence's keys from the first one its queries can see (sliding windows skip the rest) to the
last, in blocks of `BLOCK_N` positions looked up in the block table (any page size), with an
online softmax in float32; Gemma's logit softcapping and causal / windowed masks are applied per
position.

Launch parameters (`launch_config`) follow the head dimension so that a program's tiles fit in
registers (ptxas spilled at head_dim 256 with Triton's defaults); tests/test_triton_compile.py
compiles every configuration serving can produce for sm_90 and sm_80 with Triton's offline
compiler and checks for spills, since the interpreter runs code a compiler would refuse. The
arguments that change from step to step (`stride_table`, the block-table width) are not
specialised on, and the step's index tensors are 16-byte aligned (attention.py), so a warmed-up
server never compiles a variant mid-serving.

Runs on CUDA; `TRITON_INTERPRET=1` (set before this module is imported) runs the same kernel on
CPU tensors, which is how CI tests it against the reference path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from server.model.paged_step import PagedStep

# A compiled kernel may read only constexpr globals (the interpreter reads any).
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
# The interpreter multiplies bfloat16 / float16 tiles wrongly in tl.dot (their bits are taken for
# integers; checked with triton 3.9), so under it the products run in float32 after the loads.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit(do_not_specialize=["window", "stride_table"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    tile_seq_ptr,
    tile_token_ptr,
    tile_len_ptr,
    tile_pos_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_table,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    SUB_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_q = tl.program_id(2) * SUB_Q  # this program's first query within the tile
    seq = tl.load(tile_seq_ptr + tile)
    num_q = tl.minimum(tl.load(tile_len_ptr + tile) - first_q, SUB_Q)  # may be <= 0: no work
    first_pos = tl.load(tile_pos_ptr + tile) + first_q

    m = tl.arange(0, BLOCK_M)
    q_local = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = q_local < num_q
    q_pos = first_pos + q_local
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    token = tl.load(tile_token_ptr + tile) + first_q + q_local
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    last_pos = first_pos + num_q - 1  # the last key any query of the program sees
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.where(num_q > 0, last_pos + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos <= last_pos
        page = tl.load(tables_ptr + seq * stride_table + k_pos // PAGE, mask=k_ok, other=0)
        slot = page.to(tl.int64) * PAGE + k_pos % PAGE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        kv_offsets = slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # nothing visible yet: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# Register budget of one program, in tile elements: (query rows + 2 x key rows) x padded head dim
# per warp-sized slice of threads. Chosen with ptxas's reports on sm_90 (no spills at or below it,
# spills above it, for bf16 at head dims 64-256); tests/test_triton_compile.py holds it to that.
TILE_ELEMENTS_PER_WARP = 96 * 32
MAX_QUERY_ROWS = 16384  # rows x padded head dim of a program's query tile (bf16 / fp16)


@dataclass(frozen=True)
class KernelLaunch:
    """The kernel's compile-time parameters and launch shape for one kind of call."""

    constexprs: dict[str, object]
    num_warps: int
    parts: int  # programs per tile (the grid's third axis): tiles of block_q queries, SUB_Q each


def launch_config(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    block_q: int,
    page: int,
    *,
    window: bool,
    softcap: bool,
) -> KernelLaunch:
    """How to launch the kernel for queries of `dtype` with `head_dim`, `group`
    query heads per KV head, tiles of up to `block_q` queries and KV pages of `page` tokens."""
    fp32 = dtype == torch.float32 or INTERPRET
    d_pad = max(16, triton.next_power_of_2(head_dim))
    rows_cap = MAX_QUERY_ROWS // d_pad // (2 if fp32 else 1)
    sub_q = block_q
    while sub_q > 1 and sub_q * group > rows_cap:
        sub_q //= 2
    block_m = max(16, triton.next_power_of_2(sub_q * group))
    num_warps = 4 if block_m == 16 and d_pad <= 64 else 8
    budget = TILE_ELEMENTS_PER_WARP * num_warps // (2 if fp32 else 1)
    # float32 products run as FMAs (no tensor cores for exact float32): their registers grow
    # with the score tile too
    score_cap = 2048 if fp32 else block_m * 64
    block_n = next(
        n
        for n in (64, 32, 16)
        if (block_m + 2 * n) * d_pad <= budget and block_m * n <= score_cap or n == 16
    )
    constexprs: dict[str, object] = {
        "HEAD_DIM": head_dim,
        "D_PAD": d_pad,
        "GROUP": group,
        "SUB_Q": sub_q,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "PAGE": page,
        "USE_SOFTCAP": softcap,
        "USE_WINDOW": window,
        "PRECISION": "ieee" if fp32 else "tf32",
        "DOT_FP32": fp32,
    }
    return KernelLaunch(constexprs, num_warps, block_q // sub_q)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    step: PagedStep,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """q [T, H, D] (unit last stride) over the pools [slots, Hkv, D] -> [T, H, D]."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    launch = launch_config(
        q.dtype,
        head_dim,
        heads // kv_heads,
        step.block_q,
        step.block_size,
        window=window is not None,
        softcap=softcap is not None,
    )
    grid = (step.tile_seq.shape[0], kv_heads, launch.parts)
    _paged_attention_kernel[grid](
        q,
        k_pool,
        v_pool,
        out,
        step.block_tables,
        step.tile_seq,
        step.tile_token,
        step.tile_len,
        step.tile_pos,
        scale,
        softcap or 1.0,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        out.stride(0),
        out.stride(1),
        step.block_tables.stride(0),
        num_warps=launch.num_warps,
        **launch.constexprs,
    )
    return out
