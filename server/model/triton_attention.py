"""Paged attention as one Triton kernel: keys and values are read through the block table inside
the kernel, so no step materialises a row's gathered history (the gather + SDPA path in
attention.py does, once per layer per step).

One launch per layer serves the whole step: prefill / extend chunks and decode rows alike. The
packed queries are cut into tiles of up to `BLOCK_Q` tokens of one sequence; a program takes one
tile and one KV head, with that head's whole GQA group of query heads stacked in the tile's rows,
so each key and value block is loaded once per group. It walks the sequence's keys from the
first one its queries can see (sliding windows skip the rest) to the last, in blocks of
`BLOCK_N` positions looked up in the block table (any page size), with an online softmax in
float32; Gemma's logit softcapping and causal / windowed masks are applied per position.

Runs on CUDA; `TRITON_INTERPRET=1` (set before this module is imported) runs the same kernel on
CPU tensors, which is how CI tests it against the reference path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from server.model.attention import PagedStep

NEG_INF = float("-inf")
# The interpreter multiplies bfloat16 / float16 tiles wrongly in tl.dot (their bits are taken for
# integers; checked with triton 3.9), so under it the products run in float32 after the loads.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
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
    seq = tl.load(tile_seq_ptr + tile)
    first_token = tl.load(tile_token_ptr + tile)
    num_q = tl.load(tile_len_ptr + tile)
    first_pos = tl.load(tile_pos_ptr + tile)

    m = tl.arange(0, BLOCK_M)
    q_local = m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = q_local < num_q
    q_pos = first_pos + q_local
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    token = first_token + q_local
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
    last_pos = first_pos + num_q - 1  # the last key any query of the tile sees
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, last_pos + 1, BLOCK_N):
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
    group = heads // kv_heads
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    block_m = max(16, triton.next_power_of_2(step.block_q * group))
    grid = (step.tile_seq.shape[0], kv_heads)
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
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=64 if block_m <= 32 else 32,
        PAGE=step.block_size,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or INTERPRET else "tf32",
        DOT_FP32=q.dtype == torch.float32 or INTERPRET,
    )
    return out
