"""Host lists become the tensors torch.tensor would make, through the faster typed-array path."""

from __future__ import annotations

import gc

import pytest
import torch

from decoding.transfer import host_tensor, to_device

CASES = [
    ([3, -1, 2**40], torch.long),
    ((0, 7), torch.int32),
    ([0.1, 0.7, 1e-40, 3.4e39, float("inf")], torch.float32),
    ([0.1, 1 / 3], torch.float64),
    ([True, False], torch.long),
    ([1.5, -2.7], torch.long),  # floats to integers: torch.tensor's truncation, via its fallback
    ([[1, 2], [3, 4]], torch.long),  # nested: torch.tensor's shape
    ([], torch.long),
    ([], torch.float32),
    ([1, 2], None),
    ([0.5, 2], None),
]


@pytest.mark.parametrize(("values", "dtype"), CASES)
def test_a_host_list_becomes_what_torch_tensor_makes_of_it(
    values: list, dtype: torch.dtype
) -> None:
    got, want = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(to_device(values, "cpu", dtype), want)


def test_the_tensor_outlives_the_list_and_its_buffer() -> None:
    tensors = [host_tensor(list(range(i, i + 1000)), torch.long) for i in range(20)]
    gc.collect()
    _ = [list(range(10**5)) for _ in range(10)]  # reuse freed memory, if any was freed
    assert all(torch.equal(t, torch.arange(i, i + 1000)) for i, t in enumerate(tensors))
    t = host_tensor([1, 2, 3], torch.long)
    t += 1  # writable, as torch.tensor's is
    assert t.tolist() == [2, 3, 4]
