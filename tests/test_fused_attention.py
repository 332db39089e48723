"""The decode attention a compiled CPU step traces (attention._attend_fused: products and sums
that inductor fuses with the gathers of the keys and values) equals SDPA's, the eager steps'."""

from __future__ import annotations

import pytest
import torch

from server.model.attention import _attend, _attend_fused, _fuses


@pytest.mark.parametrize(
    ("heads", "kv_heads", "queries", "bias"),
    [(4, 4, 1, False), (4, 2, 1, False), (4, 1, 3, False), (3, 3, 2, True)],
    ids=["one-query", "grouped-kv", "queries-side-by-side", "relative-bias"],
)
def test_the_fused_attention_equals_sdpa(
    heads: int, kv_heads: int, queries: int, bias: bool
) -> None:
    """Rows of different lengths (a boolean mask), grouped key/value heads, several queries per
    row (a source's beams), a float mask (T5's relative position bias, -inf where unseen)."""
    torch.manual_seed(0)
    rows, length, dim = 5, 7, 16
    q = torch.randn(rows, queries, heads, dim)
    k, v = torch.randn(rows, length, kv_heads, dim), torch.randn(rows, length, kv_heads, dim)
    lengths = torch.tensor([7, 1, 4, 6, 3])
    mask = (torch.arange(length) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    if bias:
        values = torch.randn(rows, heads, 1, length)
        mask = values.masked_fill(~mask, float("-inf"))  # [B, H, 1, L]
    want = _attend(
        q.transpose(1, 2), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), mask, 0.3, None
    ).transpose(1, 2)
    got = _attend_fused(q, k, v, mask, 0.3)
    assert got.shape == want.shape == (rows, queries, heads, dim)
    assert torch.allclose(got, want, atol=1e-5)


def test_only_a_compiled_cpu_step_with_sources_fuses() -> None:
    """Eager steps keep SDPA (the exact mode's sums are generate()'s), and so do decoder-only
    models' compiled steps (slower fused, measured on Gemma 3) and a softcap (Gemma 2's)."""
    q = torch.zeros(2, 2, 4)
    assert not _fuses(q, None, sources=True)

    def traced(softcap: float | None, sources: bool) -> bool:
        step = torch.compile(lambda x: x + 1 if _fuses(x, softcap, sources) else x - 1)
        return bool(torch.equal(step(q), q + 1))

    assert traced(None, sources=True)
    assert not traced(None, sources=False)
    assert not traced(50.0, sources=True)
