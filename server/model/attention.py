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
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from decoding.transfer import to_device
from server.model.kv_cache import PagedKVCache
from server.model.paged_step import PagedStep, padded_tables

ATTENTION_NAME = "beamline_paged"


@dataclass
class SeqSlice:
    """Where one sequence's new tokens sit in the packed step and what history they see."""

    start: int  # first packed index of this sequence's tokens
    num_new: int  # tokens computed this step
    context_len: int  # tokens in cache after this step (history + new)
    gather: torch.Tensor  # [context_len] flat slot ids of the whole history, in order
    source_len: int = 0  # an encoder-decoder row's source positions (at the front)


@dataclass
class DecodeStep:
    """Rows of one new token each, as one padded batch. Passed alone as a step's context, row b is
    packed token b; inside a `StepContext`, `decode_index` maps rows to packed tokens.

    An encoder-decoder row's self-attention reads its decoder positions only, so its `gather`
    starts at the row's source length and `lengths` count from there; its cross-attention reads
    `cross`, each distinct source once (each part gathered once per step, not the whole row
    twice)."""

    slot_mapping: torch.Tensor  # [B] flat slot of each new token
    gather: torch.Tensor  # [B, L] flat slots of each row's history (and the new token), padded
    lengths: torch.Tensor  # [B, 1] tokens each row attends over
    positions: torch.Tensor  # [1, L] 0..L-1, to mask padding and out-of-window keys
    # the pools to attend over, passed in rather than found through the registered attention
    # function: an ahead-of-time compiled decoder reads them from its inputs (compiled_decode.py)
    kv: PagedKVCache | None = None
    cross: CrossStep | None = None  # encoder-decoder rows: their sources

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        lengths: list[int],
        block_size: int,
        device: torch.device,
        first: list[int] | None = None,
    ) -> DecodeStep:
        """From each row's block table and context length (history + the new token); with
        `first`, each row's history starts at that position (an encoder-decoder row's source
        length), and its length counts from there."""
        lens = torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
        if first is None:
            width = max(lengths)
            table = padded_tables(tables, -(-width // block_size)).long()
            positions = torch.arange(width)
            gather = table[:, positions // block_size] * block_size + positions % block_size
        else:
            offsets = torch.tensor(first, dtype=torch.long).unsqueeze(1)
            lens = lens - offsets
            width = max(1, int(lens.max()))
            end = -(-(max(first) + width) // block_size)
            table = padded_tables(tables, end).long()
            positions = torch.arange(width)
            absolute = (offsets + positions).clamp(max=end * block_size - 1)  # padding: any slot
            gather = table.gather(1, absolute // block_size) * block_size + absolute % block_size
        slot_mapping = gather.gather(1, (lens - 1).clamp(min=0)).squeeze(1)
        return cls(
            to_device(slot_mapping, device),
            to_device(gather, device),
            to_device(lens, device),
            to_device(positions.unsqueeze(0), device),
        )

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L]: the keys each row sees (a few element-wise ops, recomputed per layer)."""
        visible = self.positions < self.lengths
        if window is not None:
            visible &= self.positions > self.lengths - 1 - window
        return visible[:, None, None, :]


@dataclass
class CrossStep:
    """The cross-attention of a step's one-token rows of encoder-decoder models. Rows whose
    source is one (a request's beams and `n` samples, and identical sources whose blocks the
    prefix cache shares) attend over one gather of it: each distinct source is a row
    of `sources`, and its rows' queries sit side by side, `per_source` slots for each, so that
    attention reads a source's keys once for all of its rows."""

    sources: DecodeStep  # [G, L]: each distinct source's positions
    query_slots: torch.Tensor  # [B] where row b's query sits among the G x per_source slots
    per_source: int  # query slots per source: the most rows one source has

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        sources: list[int],
        block_size: int,
        device: torch.device,
        groups: list[int] | None = None,
    ) -> CrossStep:
        """From each row's block table and source length, and its request (`groups`, as
        StepPlan.source_groups): a source that ends inside a block shares that block with the
        decoder's first tokens, so each beam forked from its row holds a copy of it, another
        block with the same source positions; the request tells those rows' source is one."""
        distinct: dict[tuple[int, ...], int] = {}
        firsts: list[int] = []  # the first row of each distinct source
        counts: list[int] = []
        where: list[tuple[int, int]] = []  # (source, rank among its rows) of each row
        for row, (table, source) in enumerate(zip(tables, sources)):
            whole, tail = divmod(source, block_size)
            if tail and groups is not None:  # the last block: a copy in each forked row
                key = (source, *table[:whole], -1, groups[row])
            else:
                key = (source, *table[: whole + (tail > 0)])
            index = distinct.setdefault(key, len(firsts))
            if index == len(firsts):
                firsts.append(row)
                counts.append(0)
            where.append((index, counts[index]))
            counts[index] += 1
        width = max(counts)
        step = DecodeStep.build(
            [tables[r] for r in firsts], [sources[r] for r in firsts], block_size, device
        )
        slots = to_device([index * width + rank for index, rank in where], device, torch.long)
        return cls(step, slots, width)


@dataclass
class StepContext:
    """Context of a step with prefill chunks; its one-token rows, if any, form a `DecodeStep`."""

    slot_mapping: torch.Tensor  # [T] flat slot for every packed token
    decode: DecodeStep | None  # the sequences with one new token, as one padded batch
    decode_index: torch.Tensor | None  # [B] packed index of each of those tokens
    prefill: list[SeqSlice]  # sequences with a chunk of several tokens
    device: torch.device
    source_lens: torch.Tensor | None = None  # [T] encoder-decoder: each token's row's source
    _cache: dict = field(default_factory=dict)

    def prefill_mask(self, s: SeqSlice, window: int | None, cross: bool = False) -> torch.Tensor:
        """[1, 1, num_new, context_len] causal (and windowed) mask for one prefill chunk; `cross`:
        every query sees the row's source positions (an encoder-decoder row's)."""
        key = ("prefill", s.start, window, cross)
        if key not in self._cache:
            first = s.context_len - s.num_new
            q_pos = torch.arange(first, s.context_len, device=self.device).unsqueeze(1)
            k_pos = torch.arange(s.context_len, device=self.device).unsqueeze(0)
            if cross:
                mask = (k_pos < s.source_len).expand(s.num_new, -1)
            else:
                mask = (k_pos <= q_pos) & (k_pos >= s.source_len)
            if window is not None:
                mask &= k_pos > q_pos - window
            self._cache[key] = mask[None, None]
        return self._cache[key]


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
    k = (
        k_pool.index_select(0, step.gather.view(-1)).view(shape).permute(0, 2, 1, 3)
    )  # [B, Hkv, L, D]
    v = v_pool.index_select(0, step.gather.view(-1)).view(shape).permute(0, 2, 1, 3)
    mask = step.mask(window)
    if relative is not None:  # [B, L, H] -> [B, H, 1, L], -inf where a row sees no key
        memo = {} if memo is None else memo
        key = ("relative", id(relative), window, q.dtype)
        if key not in memo:
            bias = relative(step.positions - (step.lengths - 1)).permute(0, 2, 1).unsqueeze(2)
            memo[key] = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        mask = memo[key]
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
    sources, width = step.gather.shape[0], cross.per_source
    shape = (*step.gather.shape, *k_pool.shape[1:])
    k = k_pool.index_select(0, step.gather.view(-1)).view(shape).permute(0, 2, 1, 3)
    v = v_pool.index_select(0, step.gather.view(-1)).view(shape).permute(0, 2, 1, 3)
    side_by_side = q.new_zeros((sources * width, *q.shape[1:]))
    side_by_side.index_copy_(0, cross.query_slots, q)
    grouped = side_by_side.view(sources, width, *q.shape[1:]).transpose(1, 2)  # [G, H, W, D]
    out = _attend(grouped, k, v, step.mask(None), scaling, softcap)  # [G, H, W, D]
    return (
        out.transpose(1, 2)
        .reshape(sources * width, *q.shape[1:])
        .index_select(0, cross.query_slots)
    )


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
