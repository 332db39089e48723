"""Cross-attention of a decode step: each distinct source gathered once, its rows' queries side by
side, the same as every row attending over its own gather."""

from __future__ import annotations

import torch

from server.model.attention import _attend_decode
from server.model.packing import slots
from server.model.step_context import CrossStep, DecodeStep

BLOCK = 4


def test_rows_on_the_same_source_blocks_share_one_gather() -> None:
    # rows 0, 2, 3: one request's beams (same blocks); row 1 another source; row 4 the same
    # blocks as row 1 but a shorter source (not the same keys)
    tables = [[3, 7, 2], [5, 1], [3, 7, 9], [3, 7, 4], [5, 6]]
    sources = [6, 5, 6, 6, 3]
    cross = CrossStep.build(tables, sources, BLOCK, torch.device("cpu"))
    assert cross.sources.gather.shape[0] == 3 and cross.per_source == 3
    assert cross.query_slots.tolist() == [0, 3, 1, 2, 6]
    assert cross.sources.lengths.view(-1).tolist() == [6, 5, 3]
    assert cross.sources.gather[0, :6].tolist() == slots(tables[0], 0, 6, BLOCK).tolist()


def test_attending_per_source_equals_attending_per_row() -> None:
    torch.manual_seed(0)
    heads, dim = 2, 8
    tables = [[3, 7, 2], [5, 1], [3, 7, 9], [3, 7, 4], [0, 6]]
    sources = [6, 5, 6, 6, 3]
    k_pool, v_pool = torch.randn(2, 10 * BLOCK, heads, dim).unbind(0)
    q = torch.randn(len(tables), heads, dim)
    shared = DecodeStep.build(tables, sources, BLOCK, torch.device("cpu"))
    shared.cross = CrossStep.build(tables, sources, BLOCK, torch.device("cpu"))
    got = _attend_decode(q, k_pool, v_pool, shared, None, 0.3, None, cross=True)
    expected = _attend_decode(q, k_pool, v_pool, shared, None, 0.3, None)  # each row's own
    torch.testing.assert_close(got, expected)
