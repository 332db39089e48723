"""Per-row random streams as two integers each: a key and a counter.

A sampling row draws one uniform number per output token. Number `i` of the stream with key `k`
is a hash of `(k, i)` (a counter-based generator, the idea of Philox), so a row's whole random
state is two ints: they live in tensors, one step draws every row's number in a few tensor ops
(no Python loop, no generator object per row), and they serialize like any other per-row value.

- A row's `i`-th output token always uses number `i` of its stream, whatever else is in the batch
  and however the row got there: a speculative draft's position draws the number of the token it
  would be, a preempted row resumes where it stopped, and nothing needs rewinding.
- A seeded request's key comes from its seed (`stream_key`), so the same seed gives the same text;
  each of its rows (`n`, `best_of`) gets a key of its own (`sibling_key`). An unseeded request
  takes a key from torch's global generator when it is admitted.
- The hash works on 32-bit halves held in int64 tensors, with every product below 2^63 (the
  second multiplier is written as its negative twin, equal modulo 2^32), so nothing overflows on
  any device. Its finalizer is Wellons' `lowbias32`; the draws pass the uniformity and
  independence checks in tests/test_random_streams.py. The numbers differ from a
  `torch.Generator`'s: seeded text is this project's own, not Hugging Face's (which draws with
  `torch.multinomial`); the distribution is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decoding.transfer import host_tensor, to_device

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / phi: consecutive multiples land far apart
_MUL1 = 0x7FEB352D  # lowbias32's multipliers; the first is below 2^31
_MUL2 = 0x846CA68B - (1 << 32)  # the second as a negative number of the same residue mod 2^32
_COUNTER_MUL = 0x9E3779B1 - (1 << 32)  # 2^32 / phi, likewise


def _splitmix64(x: int) -> int:
    x = (x + GOLDEN64) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 a tensor holds."""
    return x - (1 << 64) if x >= 1 << 63 else x


def stream_key(seed: int) -> int:
    """The key of a seeded request's stream (any Python int, taken modulo 2^64)."""
    return _signed(_splitmix64(seed & MASK64))


def sibling_key(key: int, index: int) -> int:
    """The key of row `index` of a request whose first row's key is `key` (n, best_of)."""
    if index == 0:
        return key
    return _signed(_splitmix64((key + index * GOLDEN64) & MASK64))


def random_key() -> int:
    """A key for an unseeded request, from torch's global generator."""
    return int(torch.randint(-(1 << 63), (1 << 63) - 1, ()))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each value in [0, 2^32), in int64 lanes."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Number `counters[i]` of stream `keys[i]` for each i: float32 U[0, 1), multiples of 2^-24
    (float32's resolution below 1). `keys`, `counters`: int64 tensors of one shape."""
    low, high = keys & MASK32, (keys >> 32) & MASK32
    h = _mix32(((counters & MASK32) * _COUNTER_MUL & MASK32) ^ low)
    h = _mix32(h ^ high)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class RandomStreams:
    """The sampling rows' numbers in one step: row i's is number `counters[i]` of stream `keys[i]`
    (its key, and how many tokens it has output before this position).

    The hash runs on the host, where the keys and counters are, and only the numbers go to the
    device: on a GPU its ~30 element-wise ops over a few hundred values would each be a kernel
    launch, which costs the host more than computing them there."""

    values: torch.Tensor  # [S] float32, on the step's device

    @classmethod
    def of(
        cls, keys: Sequence[int], counters: Sequence[int], device: torch.device | str
    ) -> RandomStreams:
        both = host_tensor([*keys, *counters], torch.long)
        numbers = uniforms(both[: len(keys)], both[len(keys) :])
        return cls(to_device(numbers, device))

    def draw(self) -> torch.Tensor:
        """[S, 1] float32: each row's number."""
        return self.values.unsqueeze(1)
