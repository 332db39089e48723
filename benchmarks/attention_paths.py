"""Decode attention over the paged KV cache on this machine: today's gather + SDPA against
FlexAttention reading the pool through the block tables.

Why: `_attend_decode` (server/model/attention.py) copies every row's whole history out of the
pool (index_select) before SDPA, so each step moves the history twice. FlexAttention can instead
take the whole pool as the key sequence and a BlockMask whose kv_indices are each row's block
table, so a kernel only visits the row's own blocks and nothing is gathered. This script times
both per call (one layer, one query token per row) over random pools and shuffled block tables,
after checking both against a plain per-row reference.

Flex design: key/value = the pool viewed as [1, Hkv, slots, D] (no copy; batch 1 broadcast to the
B query rows by the BlockMask), query [B, H, 1, D], BlockMask with KV block = the cache's
block_size: `full_kv_indices[b]` = row b's complete blocks (no mask_mod evaluated there), and
`kv_indices[b]` = its last, partly filled block, where mask_mod looks up how many slots of that
physical block row b sees ([B, pool blocks] int32 table built with the BlockMask).

    python -m benchmarks.attention_paths                    # both shapes, rows 1/16/64, L 256/2048
    python -m benchmarks.attention_paths --rows 16 --contexts 256 --iters 10 --out paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from server.model.attention import _attend_decode
from server.model.step_context import DecodeStep

SHAPES: dict[str, tuple[int, int, int]] = {  # name -> (query heads, kv heads, head_dim)
    "gemma3-270m": (4, 1, 256),
    "llama3.2-1b": (32, 8, 64),
}

FlexFn = Callable[..., torch.Tensor]


@dataclass
class Case:
    """One decode step: random pools, shuffled block tables, one query per row."""

    q: torch.Tensor  # [B, H, D]
    k_pool: torch.Tensor  # [slots, Hkv, D]
    v_pool: torch.Tensor
    tables: list[list[int]]
    lengths: list[int]
    block_size: int
    scale: float


def make_case(
    heads: int,
    kv_heads: int,
    head_dim: int,
    rows: int,
    context: int,
    block_size: int,
    pool_blocks: int,
    seed: int = 0,
    ragged: bool = True,
) -> Case:
    """Rows get distinct random blocks out of a shuffled pool; lengths vary below `context` when
    `ragged` (so padding and partial last blocks are exercised) and every row can differ."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    if ragged:
        lengths = [context] + [rng.randint(max(1, context // 2), context) for _ in range(rows - 1)]
    else:
        lengths = [context] * rows
    need = [-(-n // block_size) for n in lengths]
    if sum(need) > pool_blocks:
        raise ValueError(f"pool of {pool_blocks} blocks cannot hold {sum(need)}")
    free = list(range(pool_blocks))
    rng.shuffle(free)
    tables, at = [], 0
    for n in need:
        tables.append(free[at : at + n])
        at += n
    slots = pool_blocks * block_size
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    return Case(q, k_pool, v_pool, tables, lengths, block_size, head_dim**-0.5)


def reference(case: Case) -> torch.Tensor:
    """Per-row gather and an explicit softmax in fp32: the ground truth for both paths."""
    out = []
    bs = case.block_size
    groups = case.q.shape[1] // case.k_pool.shape[1]
    for b, (table, n) in enumerate(zip(case.tables, case.lengths)):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        k = case.k_pool[slots].repeat_interleave(groups, dim=1)  # [n, H, D]
        v = case.v_pool[slots].repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,nhd->hn", case.q[b], k) * case.scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v))
    return torch.stack(out)


def gather_step(case: Case) -> DecodeStep:
    """Today's per-step metadata (built once per step, shared by all layers)."""
    return DecodeStep.build(case.tables, case.lengths, case.block_size, case.k_pool.device)


def gather_attend(case: Case, step: DecodeStep) -> torch.Tensor:
    """Today's path: index_select each row's history, then SDPA with a padding mask."""
    return _attend_decode(case.q, case.k_pool, case.v_pool, step, None, case.scale, None)


def flex_block_mask(case: Case) -> BlockMask:
    """BlockMask over the whole pool: row b visits its full blocks (kv_indices from its block
    table, no mask_mod there when compiled) and its last, partial block through mask_mod. The
    mask_mod itself must be exact for every (row, slot), since eager flex ignores the sparsity:
    `visible[b, p]` = slots of physical block p that row b sees (0 when not its block), so shared
    (prefix) blocks are fine. Built once per step, shared by all layers."""
    bs = case.block_size
    rows = len(case.tables)
    width = case.k_pool.shape[0] // bs  # kv_indices must span the whole key sequence (the pool)
    used = max(len(t) for t in case.tables)
    table = torch.tensor([t + [0] * (used - len(t)) for t in case.tables], dtype=torch.long)
    lens = torch.tensor(case.lengths, dtype=torch.long)
    n_full = lens // bs
    logical = torch.arange(used)
    count = (lens[:, None] - logical * bs).clamp(0, bs)  # slots seen per logical block (0: pad)
    full = torch.zeros(rows, width, dtype=torch.int32)
    full[:, :used] = torch.where(logical < n_full[:, None], table, 0).int()
    has_part = (lens % bs > 0).int()
    part = torch.zeros(rows, width, dtype=torch.int32)
    part[:, 0] = table[torch.arange(rows), n_full.clamp(max=used - 1)].int() * has_part
    # scatter_add: padding adds 0; a row never holds one physical block twice.
    visible = torch.zeros(rows, width, dtype=torch.long).scatter_add_(1, table, count).int()
    dev = case.k_pool.device
    visible = visible.to(dev)

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx % bs < visible[b, kv_idx // bs]

    return BlockMask.from_kv_blocks(
        has_part[:, None, None].to(dev),
        part[:, None, None, :].to(dev),
        n_full.int()[:, None, None].to(dev),
        full[:, None, None, :].to(dev),
        BLOCK_SIZE=(1, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, case.k_pool.shape[0]),
        compute_q_blocks=False,  # q-side indices serve only the backward pass
    )


def flex_attend(case: Case, block_mask: BlockMask, fn: FlexFn = flex_attention) -> torch.Tensor:
    """Flex over the pool viewed as one [1, Hkv, slots, D] key sequence: no gathered copy."""
    k = case.k_pool.permute(1, 0, 2).unsqueeze(0)
    v = case.v_pool.permute(1, 0, 2).unsqueeze(0)
    q = case.q.unsqueeze(2)  # [B, H, 1, D]
    out = fn(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=case.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(2)


def compiled_flex() -> FlexFn:
    """torch.compile(flex_attention); static shapes (one compile per batch size)."""
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    return torch.compile(flex_attention, dynamic=False)


def check(case: Case, flex: FlexFn) -> None:
    """Both paths against the per-row reference at fp32 (raises on mismatch)."""
    want = reference(case)
    torch.testing.assert_close(gather_attend(case, gather_step(case)), want)
    torch.testing.assert_close(flex_attend(case, flex_block_mask(case), flex), want)


def median_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median wall time of one call in milliseconds, after warm-up calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@dataclass
class Row:
    shape: str
    rows: int
    context: int
    gather_ms: float
    flex_ms: float
    ratio: float  # flex / gather
    gather_build_ms: float  # DecodeStep.build, once per step
    flex_build_ms: float  # BlockMask, once per step
    flex_compile_s: float  # first compiled call of this shape (includes any recompile)


def run_case(
    shape: str, rows: int, context: int, block_size: int, pool_blocks: int, iters: int, flex: FlexFn
) -> Row:
    """Check, then time, one (shape, rows, context) decode step."""
    heads, kv_heads, head_dim = SHAPES[shape]
    case = make_case(heads, kv_heads, head_dim, rows, context, block_size, pool_blocks, seed=rows)
    mask = flex_block_mask(case)
    t0 = time.perf_counter()
    flex_attend(case, mask, flex)
    compile_s = time.perf_counter() - t0
    check(case, flex)  # ragged lengths and partial last blocks
    # Timed with every row at exactly `context` keys, so a row of the table means that length.
    case = make_case(
        heads, kv_heads, head_dim, rows, context, block_size, pool_blocks, seed=rows, ragged=False
    )
    step = gather_step(case)
    mask = flex_block_mask(case)
    torch.testing.assert_close(flex_attend(case, mask, flex), gather_attend(case, step))
    with torch.inference_mode():
        g = median_ms(lambda: gather_attend(case, step), iters, 3)
        f = median_ms(lambda: flex_attend(case, mask, flex), iters, 3)
        gb = median_ms(lambda: gather_step(case), iters, 1)
        fb = median_ms(lambda: flex_block_mask(case), iters, 1)
    return Row(shape, rows, context, g, f, f / g, gb, fb, compile_s)


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--contexts", default="256,2048")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    rows_list = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    bs = args.block_size
    # One pool per shape, sized for the largest step plus slack, as a server's cache would be.
    pool_blocks = max(rows_list) * -(-max(contexts) // bs) * 5 // 4
    flex = compiled_flex()
    results: list[Row] = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block_size {bs}")
    header = (
        f"{'shape':<12} {'rows':>4} {'ctx':>5} {'gather ms':>10} {'flex ms':>9} {'flex/gath':>9}"
        f" {'build g/f ms':>13} {'compile s':>9}"
    )
    print(header)
    for shape in args.shapes.split(","):
        for rows in rows_list:
            for context in contexts:
                r = run_case(shape, rows, context, bs, pool_blocks, args.iters, flex)
                results.append(r)
                print(
                    f"{r.shape:<12} {r.rows:>4} {r.context:>5} {r.gather_ms:>10.3f}"
                    f" {r.flex_ms:>9.3f} {r.ratio:>9.2f}"
                    f" {r.gather_build_ms:>6.2f}/{r.flex_build_ms:<6.2f} {r.flex_compile_s:>9.1f}",
                    flush=True,
                )
    if args.out:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "block_size": bs}
        payload = {"meta": meta, "results": [asdict(r) for r in results]}
        args.out.write_text(json.dumps(payload, indent=2))
    return results


if __name__ == "__main__":
    main()
