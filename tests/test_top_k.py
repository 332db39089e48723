"""decoding/top_k.py: the two-pass selection gives torch.topk's values, and its indices point at
them, on rows long enough to take it."""

from __future__ import annotations

import pytest
import torch

from decoding import top_k
from decoding.top_k import largest


def _takes_two_passes(length: int, k: int) -> bool:
    return top_k.chunk_size(length, k) is not None


@pytest.mark.parametrize(
    ("rows", "length", "k"),
    [
        (3, 58_101, 64),
        (3, 58_101, 24),
        (2, 58_101, 40),
        (5, 4 * 58_101, 8),
        (2, 32_768, 8),
        (4, 16_384, 1),
        (2, 20_000, 2),
    ],
)
def test_equals_torch_topk_without_ties(rows: int, length: int, k: int) -> None:
    assert _takes_two_passes(length, k)
    generator = torch.Generator().manual_seed(length + k)
    x = torch.randn(rows, length, generator=generator)
    x[0, -1] = 100.0  # the largest entry in the last, shorter chunk
    x[-1, 0] = 100.0  # and in the first
    values, indices = largest(x, k)
    expected_values, expected_indices = x.topk(k, dim=-1)
    assert torch.equal(values, expected_values)
    assert torch.equal(indices, expected_indices)


def test_unsorted_is_the_same_set() -> None:
    x = torch.randn(4, 58_101, generator=torch.Generator().manual_seed(1))
    values, indices = largest(x, 64, sorted=False)
    expected = x.topk(64, dim=-1).indices
    assert torch.equal(indices.sort(dim=1).values, expected.sort(dim=1).values)
    assert torch.equal(values, x.gather(1, indices))


def test_many_largest_in_one_chunk() -> None:
    """The k largest all in one chunk: the other chunks' maxima must not push any of them out."""
    x = torch.randn(2, 40_000, generator=torch.Generator().manual_seed(2))
    x[:, 300:308] = torch.arange(8, dtype=x.dtype) + 50
    values, indices = largest(x, 8)
    assert indices[0].tolist() == list(range(307, 299, -1))
    assert torch.equal(values, x.topk(8, dim=-1).values)


def test_ties_give_the_same_values_and_point_at_them() -> None:
    x = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(3)).round()  # many ties
    values, indices = largest(x, 16)
    assert torch.equal(values, x.topk(16, dim=-1).values)
    assert torch.equal(x.gather(1, indices), values)
    assert all(len(set(row)) == 16 for row in indices.tolist())  # no entry chosen twice


def test_rows_with_fewer_finite_entries_than_k_are_torch_topks() -> None:
    """A row masked down to a few entries: its -inf candidates are the ones torch.topk picks."""
    x = torch.randn(3, 40_000, generator=torch.Generator().manual_seed(4))
    x[1] = -torch.inf
    x[1, [5, 39_999]] = torch.tensor([1.0, 2.0])
    values, indices = largest(x, 8)
    expected_values, expected_indices = x.topk(8, dim=-1)
    assert torch.equal(values, expected_values)
    assert torch.equal(indices[1], expected_indices[1])
    assert indices[1, :2].tolist() == [39_999, 5]


@pytest.mark.parametrize("k", [1, 8, 16, 24, 40, 64])
def test_chunks_are_powers_of_two_of_at_least_32(k: int) -> None:
    """The maxima's pass over a chunk of another length runs several times slower."""
    chunk = top_k.chunk_size(58_101, k)
    assert chunk is not None and chunk >= 32 and chunk & (chunk - 1) == 0
    assert chunk * k <= top_k.CANDIDATES


def test_short_rows_and_large_k_are_torch_topk() -> None:
    x = torch.randn(2, 1000)
    assert not _takes_two_passes(1000, 4)
    assert torch.equal(largest(x, 4)[1], x.topk(4, dim=-1).indices)
    y = torch.randn(2, 20_000)
    assert not _takes_two_passes(20_000, 512)
    assert torch.equal(largest(y, 512)[1], y.topk(512, dim=-1).indices)
    assert not _takes_two_passes(58_101, 100)  # chunks of 20: slower than torch.topk
