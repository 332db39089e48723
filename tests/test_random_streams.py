"""Counter-based random streams (decoding/random_streams.py): the numbers are uniform, a stream's
consecutive numbers and sibling streams are independent, and keys follow seeds.

Critical values: chi-square at alpha = 0.001 (Wilson-Hilferty), so a correct generator fails
one check in a thousand runs; the inputs are fixed, so a run that passes always passes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from decoding.random_streams import (
    RandomStreams,
    random_key,
    sibling_key,
    stream_key,
    uniforms,
)


def chi2_critical(df: int, z: float = 3.09) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_uniform(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_numbers_lie_in_the_unit_interval_on_float32_s_grid() -> None:
    u = uniforms(torch.arange(-5000, 5000), torch.arange(10_000) * 7919)
    assert u.dtype == torch.float32
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert torch.equal(u * 2**24, (u * 2**24).round())


@pytest.mark.parametrize("layout", ["one-stream", "many-streams", "siblings"])
def test_numbers_are_uniform(layout: str) -> None:
    n = 1 << 18
    if layout == "one-stream":  # one row over a long generation
        keys, counters = torch.full((n,), stream_key(42)), torch.arange(n)
    elif layout == "many-streams":  # many requests' first tokens (seeds 0, 1, 2...)
        keys, counters = (
            torch.tensor([stream_key(s) for s in range(n)]),
            torch.zeros(n, dtype=torch.long),
        )
    else:  # the rows of one n request, a few tokens each
        keys = torch.tensor([sibling_key(stream_key(9), k) for k in range(n // 8)]).repeat(8)
        counters = torch.arange(8).repeat_interleave(n // 8)
    u = uniforms(keys, counters)
    bins = 256
    counts = torch.bincount((u * bins).long(), minlength=bins).float()
    assert chi2_uniform(counts) < chi2_critical(bins - 1)


@pytest.mark.parametrize("pairing", ["next-counter", "next-sibling", "next-seed"])
def test_neighbouring_numbers_are_independent(pairing: str) -> None:
    """(u, v) pairs of neighbours fill a 16 x 16 grid evenly: consecutive tokens of a row, the same
    token of sibling rows, the same token of requests with consecutive seeds."""
    n = 1 << 17
    index = torch.arange(n)
    if pairing == "next-counter":
        key = torch.full((n,), stream_key(1))
        u, v = uniforms(key, index), uniforms(key, index + 1)
    elif pairing == "next-sibling":
        base = stream_key(2)
        keys = torch.tensor([sibling_key(base, k) for k in range(n + 1)])
        u, v = (
            uniforms(keys[:-1], torch.zeros(n, dtype=torch.long)),
            uniforms(keys[1:], torch.zeros(n, dtype=torch.long)),
        )
    else:
        keys = torch.tensor([stream_key(s) for s in range(n + 1)])
        zero = torch.full((n,), 5)
        u, v = uniforms(keys[:-1], zero), uniforms(keys[1:], zero)
    cells = (u * 16).long() * 16 + (v * 16).long()
    counts = torch.bincount(cells, minlength=256).float()
    assert chi2_uniform(counts) < chi2_critical(255)
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.02


def test_keys_follow_seeds_and_every_seed_is_accepted() -> None:
    seeds = [0, 1, -1, 2**63, 2**64 + 5, -(2**70) + 7, 123456789]
    keys = [stream_key(s) for s in seeds]
    assert keys == [stream_key(s) for s in seeds]  # the same seed, the same stream
    assert len(set(keys)) == len(keys)
    assert stream_key(2**64) == stream_key(0)  # seeds count modulo 2^64
    assert all(-(2**63) <= k < 2**63 for k in keys)  # an int64
    assert sibling_key(keys[0], 0) == keys[0]  # a request's first row has the request's key
    siblings = [sibling_key(keys[0], k) for k in range(1000)]
    assert len(set(siblings)) == 1000
    torch.manual_seed(3)
    drawn = random_key()
    torch.manual_seed(3)
    assert random_key() == drawn and -(2**63) <= drawn < 2**63  # torch.manual_seed governs it


def test_a_step_draws_each_row_s_number_whatever_the_batch() -> None:
    """A row's number depends on its key and counter only: alone, or among other rows."""
    keys, counters = [stream_key(s) for s in range(5)], [0, 3, 3, 17, 400]
    together = RandomStreams.of(keys, counters, "cpu").draw()
    assert together.shape == (5, 1)
    for r in range(5):
        alone = RandomStreams.of([keys[r]], [counters[r]], "cpu").draw()
        assert torch.equal(alone[0], together[r])


def test_a_step_s_numbers_are_the_hash_of_its_rows_keys_and_counters() -> None:
    """`RandomStreams.of` hashes on the host and sends the numbers: each is `uniforms`' number for
    its row, negative and 64-bit keys and counters past 2^32 included."""
    keys = [stream_key(s) for s in (0, 1, -7, 2**70)] + [random_key() for _ in range(60)]
    counters = [0, 1, 2**32 + 5, 123_456_789] + list(range(60))
    got = RandomStreams.of(keys, counters, "cpu").draw()
    assert got.shape == (64, 1) and got.dtype == torch.float32
    assert torch.equal(got[:, 0], uniforms(torch.tensor(keys), torch.tensor(counters)))
    assert RandomStreams.of([], [], "cpu").draw().shape == (0, 1)


class DeviceOps(TorchDispatchMode):
    """The ops that touch a tensor on `device` (on a GPU: the kernels launched there)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.ops = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(
            t.device.type == self.device
            for t in (*tensors, *results)
            if isinstance(t, torch.Tensor)
        ):
            self.ops.append(str(func.overloadpacket))
        return out


def test_the_hash_runs_on_the_host_and_one_copy_takes_the_numbers_to_the_device() -> None:
    """On a GPU each of the hash's ~30 element-wise ops would be a kernel launch; the step's
    device sees one copy of the numbers ("meta" stands in for it here)."""
    keys, counters = [stream_key(s) for s in range(16)], list(range(16))
    with DeviceOps("meta") as seen:
        numbers = RandomStreams.of(keys, counters, "meta").draw()
    assert numbers.device.type == "meta" and numbers.shape == (16, 1)
    assert seen.ops == ["aten._to_copy", "aten.unsqueeze"]  # the copy, then a view
