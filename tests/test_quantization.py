"""Weight-only int8 linears: close to the float layer, batch-independent, only where the kernel works."""

from __future__ import annotations

import torch
from torch import nn

from server.engine.quantization import (
    Int8WeightOnlyLinear,
    kernel_supports,
    quantize_decoder_weights,
)


@torch.inference_mode()
def test_int8_weight_only_linear_is_close_to_the_float_layer() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Int8WeightOnlyLinear(linear.weight, linear.bias)
    x = torch.randn(2, 5, 64)
    out, ref = q(x), linear(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.02  # int8 weights, bf16 activations
    # The stored weights reconstruct the originals to within half a quantization step per channel.
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((q.dequantized_weight() - linear.weight).abs() <= step * 0.51 + 1e-3).all())


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    torch.manual_seed(1)
    q = Int8WeightOnlyLinear(torch.randn(32, 64), None)
    x = torch.randn(16, 64)
    alone = torch.cat([q(x[i : i + 1]) for i in range(16)])
    assert torch.equal(q(x), alone)


def test_only_layers_the_kernel_supports_are_quantized() -> None:
    assert kernel_supports(640) and kernel_supports(16) and not kernel_supports(24)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4))
    assert quantize_decoder_weights(model, torch.device("cpu")) == 2
    assert isinstance(model[0], Int8WeightOnlyLinear) and isinstance(model[2], Int8WeightOnlyLinear)
    assert type(model[3]) is nn.Linear  # K = 8: left in floating point
    assert model(torch.randn(3, 64)).shape == (3, 4)
