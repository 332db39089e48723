"""The int8 LM head's row products: close to float32, each row independent of its batch-mates, the
oneDNN kernel where it runs and fbgemm's otherwise."""

from __future__ import annotations

import pytest
import torch

from server.model import int8_products
from server.model.int8_products import (
    FbgemmRowProduct,
    OneDNNRowProduct,
    onednn_int8_works,
    row_product,
)
from server.model.quantization import RescoredInt8Head

# Without VNNI (AVX2 alone) oneDNN's u8 x s8 pair sums saturate at 16 bits: its 8-bit product is
# wrong there, the check refuses it and the head runs fbgemm's.
where_onednn_runs = pytest.mark.skipif(
    not onednn_int8_works(), reason="oneDNN's int8 linear saturates on this CPU (no VNNI)"
)


@pytest.mark.parametrize(
    "kernel", [pytest.param(OneDNNRowProduct, marks=where_onednn_runs), FbgemmRowProduct]
)
@torch.inference_mode()
def test_each_row_is_quantized_alone_and_close_to_float(kernel: type[torch.nn.Module]) -> None:
    torch.manual_seed(1)
    weight = torch.randn(3000, 96) * 0.05
    product = kernel(weight)
    x = torch.randn(9, 96)
    x[2] *= 50  # a loud row
    x[5] *= 1e-3  # a quiet one
    exact = x @ weight.t()
    got = product(x)
    # int8 error relative to each row's own scale: the quiet row keeps its precision
    error = (got - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)
    assert float(error.max()) < 0.03
    alone = torch.cat([product(x[i : i + 1]) for i in range(9)])
    assert torch.equal(got, alone)  # bit for bit: no row depends on its batch-mates


@where_onednn_runs
@torch.inference_mode()
def test_onednn_keeps_eight_bits_where_fbgemm_keeps_seven() -> None:
    """oneDNN's unsigned 8-bit activations (zero point 128) against fbgemm's reduced range."""
    torch.manual_seed(2)
    weight = torch.randn(2000, 128) * 0.05
    x = torch.randn(16, 128)
    exact = x @ weight.t()
    errors = [
        float((k(weight)(x) - exact).abs().mean()) for k in (OneDNNRowProduct, FbgemmRowProduct)
    ]
    assert errors[0] < 0.8 * errors[1]


def test_the_head_takes_onednn_where_it_runs_and_fbgemm_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.randn(500, 32)
    # PyTorch's x86 CPU builds carry oneDNN's int8 linear: it runs wherever the CPU has VNNI
    assert onednn_int8_works() or not torch.cpu._is_vnni_supported()
    monkeypatch.setattr(int8_products, "onednn_int8_works", lambda: True)
    assert isinstance(row_product(weight), OneDNNRowProduct)
    assert "(oneDNN)" in repr(RescoredInt8Head(weight))
    monkeypatch.setattr(int8_products, "onednn_int8_works", lambda: False)
    assert isinstance(row_product(weight), FbgemmRowProduct)
    head = RescoredInt8Head(weight)
    assert "(fbgemm)" in repr(head)
    x = torch.randn(3, 32)
    top = (x @ weight.t()).argmax(dim=1)
    assert torch.equal(head(x).argmax(dim=1), top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_quantized_a_block_of_rows_at_a_time_are_the_whole_matrix_formula(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int8_products, "QUANTIZED_BLOCK", 7 * 24)  # 7 rows, and a part-block
    weight = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    weight[5] = 0  # a row of zeros: the smallest scale, not a division by zero
    before = weight.clone()
    q, scales = int8_products.quantize_per_channel(weight)
    expected_scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    expected = torch.round(weight.float() / expected_scales[:, None]).clamp(-127, 127)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(q, expected.to(torch.int8))
    assert torch.equal(weight, before)  # the model's weight is read, never written
