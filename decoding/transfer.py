"""Host-to-device copies that never wait for the device.

On CUDA a copy from pageable host memory synchronises the stream: it waits for every kernel queued
before it, e.g. the forward pass the engine queued so that the host could prepare the next step
meanwhile (async scheduling). From pinned memory with `non_blocking` the copy is queued like a
kernel and the host goes on; torch's pinned allocator keeps the buffer alive until it has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: torch.Tensor | Sequence[int] | Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`values` (a tensor, or a list made one) on `device`, as `dtype` if given."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    target = torch.device(device)
    if target.type == "cpu" and tensor.device.type != "cpu":
        return tensor.to(target)  # to the host: a non-blocking copy would not be waited for
    if target.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(target, non_blocking=True)  # a no-op on the tensor's own device
