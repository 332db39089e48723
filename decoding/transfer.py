"""Host-to-device copies that never wait for the device.

On CUDA a copy from pageable host memory synchronises the stream: it waits for every kernel queued
before it, e.g. the forward pass the engine queued so that the host could prepare the next step
meanwhile (async scheduling). From pinned memory with `non_blocking` the copy is queued like a
kernel and the host goes on; torch's pinned allocator keeps the buffer alive until it has run.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

# A flat list of Python numbers becomes a tensor about 4x faster through a typed `array` (one C
# loop over the items, then a tensor over its buffer) than through torch.tensor (15 against 55-70
# us for 256 items): input building and sampling turn several such lists into tensors a step.
_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def to_device(
    values: torch.Tensor | Sequence[int] | Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`values` (a tensor, or a list made one) on `device`, as `dtype` if given."""
    tensor = values if isinstance(values, torch.Tensor) else host_tensor(values, dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    target = torch.device(device)
    if target.type == "cpu" and tensor.device.type != "cpu":
        return tensor.to(target)  # to the host: a non-blocking copy would not be waited for
    if target.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(target, non_blocking=True)  # a no-op on the tensor's own device


def host_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype | None) -> torch.Tensor:
    """`values` as a new CPU tensor of `dtype` (inferred when None), as torch.tensor makes it."""
    code = _ARRAY_CODES.get(dtype) if dtype is not None else None
    if code is not None and dtype is not None and len(values) > 0:
        try:
            return torch.frombuffer(array.array(code, values), dtype=dtype)
        except (TypeError, OverflowError):  # not a flat list of numbers of that kind
            pass
    return torch.tensor(values, dtype=dtype)
