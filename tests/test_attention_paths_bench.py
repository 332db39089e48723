"""The attention-paths benchmark's two decode paths stay correct (tiny shapes), so it never rots."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks import attention_paths as ap


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 32), (8, 2, 16)])
def test_both_paths_match_the_reference_eager_flex(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    # Eager flex evaluates mask_mod on every (row, slot) of the pool: this checks the mask exactly.
    case = ap.make_case(heads, kv_heads, head_dim, rows=3, context=37, block_size=8, pool_blocks=24)
    ap.check(case, flex_attention)


def test_shared_prefix_blocks_are_seen_by_every_row() -> None:
    """Copy-on-write prefix sharing: one physical block in several rows' tables."""
    case = ap.make_case(4, 2, 16, rows=3, context=29, block_size=8, pool_blocks=16, seed=3)
    shared = case.tables[0][0]
    tables = [[shared] + t[1:] for t in case.tables]
    ap.check(replace(case, tables=tables), flex_attention)


def test_the_benchmark_runs_compiled(tmp_path: Path) -> None:
    """End to end through main(): compiled flex (one compile, a few seconds) and the JSON."""
    out = tmp_path / "paths.json"
    rows = ap.main(
        ["--shapes", "gemma3-270m", "--rows", "2", "--contexts", "24", "--iters", "2"]
        + ["--block-size", "8", "--out", str(out)]
    )
    assert [(r.shape, r.rows, r.context) for r in rows] == [("gemma3-270m", 2, 24)]
    assert rows[0].gather_ms > 0 and rows[0].flex_ms > 0
    assert json.loads(out.read_text())["results"][0]["rows"] == 2
    torch._dynamo.reset()
