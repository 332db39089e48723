"""The k largest entries of long rows (a vocabulary, or a beam search's beams x vocabulary) on the
CPU, in two passes instead of one selection over every entry.

`torch.topk` on the CPU runs a partial sort over each whole row: about 2.5 ms for 16 rows of 4 x
58k candidates at k = 8 on one core, and 5 ms for 64 rows of 58k at k = 64, a large part of a
translation model's beam step. Here each row is cut into chunks, the chunks' maxima are taken
(one vectorised pass), and the selection runs only over the k chunks with the largest maxima: the
k largest entries lie in them (an entry outside them has k chunk maxima, k other entries, at or
above it). The values are exactly `torch.topk`'s; where several entries tie at the k-th value,
the one chosen may differ, as `torch.topk`'s own choice among ties is unspecified. Rows whose
k-th value is -inf (fewer than k finite entries, as masks leave them) are selected again by
`torch.topk`, so that the masked entries chosen are the ones it chooses.

CUDA tensors, short rows and large k go to `torch.topk` directly: its GPU selection is fast, and
below `MIN_LENGTH` the two passes do not pay.
"""

from __future__ import annotations

import torch

MIN_LENGTH = 16_384  # entries per row below which torch.topk is as fast
CANDIDATES = 2048  # entries per row the second pass selects from (k chunks of this / k)
MIN_CHUNK = 32  # shorter chunks: the maxima's pass costs as much as one torch.topk


def chunk_size(length: int, k: int) -> int | None:
    """The chunk the two passes cut rows of `length` into for the top `k`; None where one
    `torch.topk` is as fast (short rows, or so large a k that few chunks would be left out)."""
    per_chunk = CANDIDATES // max(k, 1)
    if k < 1 or per_chunk < MIN_CHUNK:
        return None
    # a power of two: the maxima's pass over other chunk sizes runs 2-10x slower on the CPU
    chunk = min(256, 1 << per_chunk.bit_length() - 1)
    return chunk if length >= max(MIN_LENGTH, 4 * k * chunk) else None


def largest(x: torch.Tensor, k: int, *, sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1, sorted=sorted)` of a 2-D `x`: (values, indices) [rows, k]."""
    rows, length = x.shape
    chunk = chunk_size(length, k)
    if x.device.type != "cpu" or chunk is None:
        return x.topk(k, dim=-1, sorted=sorted)
    whole = length // chunk * chunk
    maxima = x[:, :whole].view(rows, -1, chunk).amax(dim=2)
    if whole < length:  # the last, shorter chunk
        maxima = torch.cat([maxima, x[:, whole:].amax(dim=1, keepdim=True)], dim=1)
    chunks = maxima.topk(k, dim=1, sorted=False).indices
    positions = (chunks.unsqueeze(2) * chunk + torch.arange(chunk)).view(rows, -1)
    beyond = positions >= length  # the last chunk's missing entries
    candidates = x.gather(1, positions.clamp(max=length - 1)).masked_fill_(beyond, -torch.inf)
    values, where = candidates.topk(k, dim=1, sorted=sorted)
    indices = positions.gather(1, where)
    masked = values.amin(dim=1) == -torch.inf
    if bool(masked.any()):
        values[masked], indices[masked] = x[masked].topk(k, dim=1, sorted=sorted)
    return values, indices
