"""Paged attention for transformers models, registered through transformers' AttentionInterface.

The model is called with the step's tokens packed as one row ([1, T]) and a `StepContext` passed as
the keyword `beamline_ctx`; transformers hands extra keywords to the attention function unchanged.
Each layer writes the new keys/values into its slots of the block pool, then every sequence attends
over its own history read through its block table. Decode rows (one query each) run as one padded
batch (a `DecodeStep`); prefill chunks run one sequence at a time. Gather indices are built once
per step and shared by all layers; sliding-window layers (Gemma 3, Mistral) get a windowed mask.

A step in which every sequence adds exactly one token (the steady state of serving) is passed as
a bare `DecodeStep` instead of a `StepContext`: tensors only, no Python lists and no per-step cache,
so that `torch.compile` can trace the whole decoder through it (see runner.py).

An encoder-decoder model's row holds its source first (model/seq2seq/): positions below the row's
`source_len` keep every decoder layer's cross-attention keys and values of the source, the
decoder's own tokens follow. A cross-attention layer (its module marked `beamline_cross`) writes
nothing and attends over the source positions; a self-attention layer attends over the decoder's
positions only. Decoder-only rows have no source (`source_lens` None, `source_len` 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from server.model.kv_cache import PagedKVCache
from server.model.paged_step import PagedStep
from server.model.step_context import CrossStep, DecodeStep, SeqSlice, StepContext

ATTENTION_NAME = "beamline_paged"


RelativeBias = Callable[[torch.Tensor], torch.Tensor]  # key - query distances -> [..., H]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], a mask broadcastable to [B, H, Q, L] (boolean, or a
    float one added to the scores); `bias` (T5's relative position bias, [B, H, Q, L]) is added
    to the scores."""
    if bias is not None:
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scaling / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _fuses(q: torch.Tensor, softcap: float | None, sources: bool) -> bool:
    """Whether attention is written as products and sums (`_attend_fused`): while
    torch.compile traces an encoder-decoder model's CPU step. Inductor fuses them with the
    gathers of the keys and values, where its SDPA first copies them into its own layout: the
    benchmarks' Marian and T5-base workloads ran 5-8% and 11% faster (in process, one thread).
    Gemma 3's decoder-only step ran 12% slower with them, though its shapes were faster alone;
    it keeps SDPA, as eager steps do (their sums are the ones generate() makes). `sources`: the
    step's rows have sources."""
    compiled_cpu = q.device.type == "cpu" and torch.compiler.is_compiling()
    return compiled_cpu and softcap is None and sources


def _attend_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [B, Q, H, D], k/v [B, L, Hkv, D] as gathered (not permuted), a mask broadcastable to
    [B, H, Q, L] (boolean, or a float one added to the scores) -> [B, Q, H, D], in float32.
    (A compiled CPU step with 32 rows of 48 keys, 8 heads: 2-3x faster than inductor's SDPA.)"""
    b, queries, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.float().view(b, queries, 1, kv_heads, group, dim)
    kg = k.float().view(b, 1, length, kv_heads, 1, dim)
    scores = ((qg * kg).sum(-1) * scaling).view(b, queries, length, heads)
    where = mask.permute(0, 2, 3, 1)  # [B, Q, L, H], broadcast
    if where.dtype == torch.bool:
        scores = scores.masked_fill(~where, float("-inf"))
    else:
        scores = scores + where.float()
    weights = scores.softmax(dim=2).view(b, queries, length, kv_heads, group, 1)
    out = (weights * v.float().view(b, 1, length, kv_heads, 1, dim)).sum(2)
    return out.view(b, queries, heads, dim).to(q.dtype)


def _attend_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    step: DecodeStep,
    window: int | None,
    scaling: float,
    softcap: float | None,
    cross: bool = False,
    relative: RelativeBias | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """q [B, H, D], one query per row, over each row's history in the pools -> [B, H, D];
    `relative`: the layer's relative position bias (T5), kept in `memo` (the step's) as the
    float mask it becomes: T5's layers share one, which the step's distances fix."""
    if cross:
        if step.cross is None:
            raise RuntimeError("a cross-attention layer in a step without sources")
        return _attend_sources(q, k_pool, v_pool, step.cross, scaling, softcap)
    shape = (*step.gather.shape, *k_pool.shape[1:])
    k = k_pool.index_select(0, step.gather.view(-1)).view(shape)  # [B, L, Hkv, D]
    v = v_pool.index_select(0, step.gather.view(-1)).view(shape)
    mask = step.mask(window)
    if relative is not None:  # [B, L, H] -> [B, H, 1, L], -inf where a row sees no key
        memo = {} if memo is None else memo
        key = ("relative", id(relative), window, q.dtype)
        if key not in memo:
            bias = relative(step.positions - (step.lengths - 1)).permute(0, 2, 1).unsqueeze(2)
            memo[key] = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        mask = memo[key]
    if _fuses(q, softcap, step.cross is not None):
        return _attend_fused(q.unsqueeze(1), k, v, mask, scaling).squeeze(1)
    k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    return _attend(q.unsqueeze(2), k, v, mask, scaling, softcap).squeeze(2)


def _attend_sources(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    cross: CrossStep,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, H, D], one query per row, over its source's keys -> [B, H, D]: the queries of one
    source's rows side by side against one gather of its keys (CrossStep)."""
    step = cross.sources
    shape = (*step.gather.shape, *k_pool.shape[1:])
    k = k_pool.index_select(0, step.gather.view(-1)).view(shape)  # [G, L, Hkv, D]
    v = v_pool.index_select(0, step.gather.view(-1)).view(shape)
    with_none = torch.cat([q, q.new_zeros((1, *q.shape[1:]))])  # slot_rows' B: no row
    side_by_side = with_none.index_select(0, cross.slot_rows.view(-1))
    grouped = side_by_side.view(*cross.slot_rows.shape, *q.shape[1:])  # [G, W, H, D]
    if _fuses(q, softcap, sources=True):
        out = _attend_fused(grouped, k, v, step.mask(None), scaling)
    else:
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        out = _attend(grouped.transpose(1, 2), k, v, step.mask(None), scaling, softcap)
        out = out.transpose(1, 2)  # [G, W, H, D]
    return out.flatten(0, 1).index_select(0, cross.query_slots)


def _keep_scores(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    s: SeqSlice,
    scaling: float,
    kept: dict[int, dict[int, torch.Tensor]],
) -> None:
    """Keep an aligned slice's scaled query-key products at the layer's alignment heads (the
    runner marks them, `beamline_alignment_heads`) over its source positions, before softmax."""
    heads = getattr(module, "beamline_alignment_heads", None)
    if not heads:
        return
    index = torch.tensor(heads, device=q.device)
    group = q.shape[1] // k.shape[1]  # grouped keys: a query head's key head
    qh = q[0].index_select(0, index)  # [h, n, D]
    kh = k[0].index_select(0, index // group)[:, : s.source_len]  # [h, S, D]
    layer = cast(int, module.layer_idx)
    kept.setdefault(s.start, {})[layer] = (qh.float() @ kh.float().transpose(1, 2)) * scaling


PagedKernel = Callable[..., torch.Tensor]  # triton_attention.paged_attention's signature


def make_paged_attention(cache: PagedKVCache, kernel: PagedKernel | None = None):
    """Build the attention function bound to one KV cache; `kernel` serves `PagedStep` contexts
    (the runner passes triton_attention.paged_attention when that backend is chosen)."""

    def paged_attention(
        module: torch.nn.Module,
        query: torch.Tensor,  # [1, H, T, D]
        key: torch.Tensor,  # [1, Hkv, T, D]
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        beamline_ctx: StepContext | DecodeStep | PagedStep | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, None]:
        if beamline_ctx is None:
            if getattr(module, "beamline_unpaged", False):  # an encoder's: no cache, its mask
                return ALL_ATTENTION_FUNCTIONS["sdpa"](
                    module, query, key, value, attention_mask, scaling=scaling, **_
                )
            raise RuntimeError("beamline paged attention called without a step context")
        ctx = beamline_ctx
        layer = cast(int, module.layer_idx)
        scale = cast(int, module.head_dim) ** -0.5 if scaling is None else scaling
        pools = ctx.kv if isinstance(ctx, DecodeStep) and ctx.kv is not None else cache
        k_pool, v_pool = pools.keys[layer], pools.values[layer]
        cross = getattr(module, "beamline_cross", False)  # its keys are in the pool already
        relative = getattr(module, "beamline_relative_bias", None)  # T5's self-attention
        if not cross:  # index_copy_/index_select: several times faster on CPU than indexing
            k_pool.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype))
            v_pool.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype))

        q = query[0].transpose(0, 1)  # [T, H, D]
        if isinstance(ctx, PagedStep):
            if kernel is None or cross:
                raise RuntimeError("a PagedStep needs the paged-attention kernel, and no source")
            window = sliding_window
            out = kernel(q, k_pool, v_pool, ctx, scale=scale, softcap=softcap, window=window)
            return out.unsqueeze(0), None
        if isinstance(ctx, DecodeStep):
            out = _attend_decode(
                q, k_pool, v_pool, ctx, sliding_window, scale, softcap, cross, relative
            )
            return out.unsqueeze(0), None
        out = torch.empty_like(q)
        if ctx.decode is not None and ctx.decode_index is not None:
            qd = q.index_select(0, ctx.decode_index)
            rest = (sliding_window, scale, softcap, cross, relative, ctx._cache)
            attended = _attend_decode(qd, k_pool, v_pool, ctx.decode, *rest)
            out.index_copy_(0, ctx.decode_index, attended)
        for s in ctx.prefill:
            qp = q[s.start : s.start + s.num_new].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            kp = k_pool.index_select(0, s.gather).permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, L, D]
            vp = v_pool.index_select(0, s.gather).permute(1, 0, 2).unsqueeze(0)
            mask = ctx.prefill_mask(s, sliding_window, cross)
            if cross and s.aligned and ctx.cross_scores is not None:
                _keep_scores(module, qp, kp, s, scale, ctx.cross_scores)
            bias = None
            if relative is not None:  # [n, L, H] -> [1, H, n, L]
                k_pos = torch.arange(s.context_len, device=q.device)
                q_pos = k_pos[s.context_len - s.num_new :]
                bias = relative(k_pos[None, :] - q_pos[:, None]).permute(2, 0, 1).unsqueeze(0)
            out[s.start : s.start + s.num_new] = _attend(qp, kp, vp, mask, scale, softcap, bias)[
                0
            ].transpose(0, 1)
        return out.unsqueeze(0), None

    return paged_attention
