"""int8 linears (weight-only, and int8 x int8 with per-token scales): close to the float layer,
batch-independent, only where the kernel works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from server.model.quantization import (
    MIN_RESCORED,
    RESCORED_CANDIDATES,
    WEIGHT_ONLY,
    WEIGHT_ONLY_UNDER_W8A8,
    WEIGHT_ONLY_UNSMOOTHED,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    RescoredInt8Head,
    head_logits,
    kernel_supports,
    quantize_decoder_weights,
    quantize_w8a8,
    quantized_lm_head,
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


@torch.inference_mode()
def test_int8_dynamic_linear_is_the_integer_product_of_its_quantized_operands() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(40, 24)  # K = 40: the integer GEMM takes any size
    q = Int8DynamicLinear(linear.weight, linear.bias)
    x = torch.randn(3, 40)
    x[1] *= 50  # one loud row must not coarsen the others' scales
    row_scales = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x / row_scales).clamp(-127, 127)
    want = (
        xq.double() @ q.weight_int8.double().t()
    ) * row_scales.double() * q.scales.double() + linear.bias.double()
    out = q(x)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-5)
    ref = linear(x)
    assert float(((out - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)).max()) < 0.03


@torch.inference_mode()
def test_int8_dynamic_rows_do_not_depend_on_their_batch_mates() -> None:
    torch.manual_seed(3)
    q = Int8DynamicLinear(torch.randn(32, 64), None)
    x = torch.randn(16, 64)
    x[5] *= 100
    alone = torch.cat([q(x[i : i + 1]) for i in range(16)])
    assert torch.equal(q(x), alone)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inner)
        self.down_proj = nn.Linear(inner, hidden)


def test_w8a8_keeps_down_proj_weight_only_and_quantizes_the_rest() -> None:
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 32), "mlp": _MLP(64, 128), "odd": _MLP(64, 24)})
    assert quantize_w8a8(model, torch.device("cpu")) == 4
    assert isinstance(model["q_proj"], Int8DynamicLinear)  # smoothed where calibrated
    assert isinstance(model["mlp"].up_proj, Int8DynamicLinear)
    assert isinstance(model["mlp"].down_proj, Int8WeightOnlyLinear)
    assert isinstance(model["odd"].up_proj, Int8DynamicLinear)
    assert (
        type(model["odd"].down_proj) is nn.Linear
    )  # K = 24: the weight-only kernel can't, float stays


def test_unsmoothed_w8a8_keeps_the_attention_inputs_weight_only() -> None:
    """An encoder-decoder model's w8a8 is not smoothed: q/k/v stay weight-only, as before."""
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 32), "mlp": _MLP(64, 128)})
    assert quantize_w8a8(model, torch.device("cpu"), WEIGHT_ONLY_UNSMOOTHED) == 3
    assert isinstance(model["q_proj"], Int8WeightOnlyLinear)
    assert isinstance(model["mlp"].down_proj, Int8WeightOnlyLinear)
    assert isinstance(model["mlp"].up_proj, Int8DynamicLinear)


def test_w8a8_all_runs_every_layer_as_an_integer_gemm() -> None:
    """`w8a8-all` (CTranslate2's int8): the layers w8a8 keeps weight-only are integer GEMMs too,
    a K the weight-only kernel cannot take included."""
    model = nn.ModuleDict({"q_proj": nn.Linear(64, 32), "mlp": _MLP(64, 128), "odd": _MLP(64, 24)})
    assert quantize_w8a8(model, torch.device("cpu"), WEIGHT_ONLY["w8a8-all"]) == 5
    layers = [model["q_proj"], model["mlp"].up_proj, model["mlp"].down_proj, model["odd"].down_proj]
    assert all(isinstance(layer, Int8DynamicLinear) for layer in layers)
    assert WEIGHT_ONLY["w8a8"] == WEIGHT_ONLY_UNDER_W8A8


def test_w8a8_is_cpu_only() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        quantize_w8a8(nn.Linear(16, 16), torch.device("cuda"))


@torch.inference_mode()
def test_the_rescored_head_gives_every_candidate_its_exact_logit() -> None:
    torch.manual_seed(4)
    weight = torch.randn(5000, 64)
    head = RescoredInt8Head(weight, candidates=32)
    x = torch.randn(12, 64)
    x[3] *= 40  # one loud row must not disturb the others
    exact = x @ weight.t()
    got = head(x)
    top = exact.topk(8, dim=1).indices
    # the floating-point top 8 are all among the rescored candidates: their logits are exact
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
    # the tail keeps int8 error, small against the logits' spread
    assert float((got - exact).abs().max()) < 0.05 * float(exact.abs().max())
    alone = torch.cat([head(x[i : i + 1]) for i in range(12)])
    assert torch.equal(head(x), alone)


@torch.inference_mode()
def test_a_step_whose_rows_read_few_tokens_rescores_fewer_candidates() -> None:
    """`ranked` (StepPlan.ranked): MIN_RESCORED at least, RANKED_MARGIN x ranked, at most the
    head's own count; exactly those candidates get their floating-point logits, the rest keep
    their int8 ones."""
    torch.manual_seed(5)
    weight = torch.randn(5000, 64)
    head = RescoredInt8Head(weight)
    assert [head.rescored(r) for r in (0, 1, 8, 16, 30)] == [64, MIN_RESCORED, 24, 48, 64]
    x = torch.randn(6, 64)
    exact, approx = x @ weight.t(), head.approximate(x)
    for ranked in (1, 8):
        got = head_logits(head, x, ranked)
        changed = (got != approx).sum(dim=1)
        assert changed.max() <= head.rescored(ranked) and changed.min() > 0
        top = approx.topk(head.rescored(ranked), dim=1).indices
        assert torch.allclose(got.gather(1, top), exact.gather(1, top), atol=1e-5)
        assert torch.equal(got.argmax(dim=1), exact.argmax(dim=1))
    assert torch.equal(head_logits(head, x), head(x))  # 0: every candidate
    plain = nn.Linear(64, 10)
    assert torch.equal(head_logits(plain, x, 1), plain(x))  # other heads take no count


@torch.inference_mode()
def test_the_rescored_head_reads_the_models_weight_without_a_copy() -> None:
    embedding = nn.Embedding(300, 32)
    head = quantized_lm_head(nn.Linear(32, 300, bias=False), torch.device("cpu"), "int8")
    assert isinstance(head, RescoredInt8Head) and head.candidates == RESCORED_CANDIDATES
    tied = nn.Linear(32, 300, bias=False)
    tied.weight = embedding.weight
    head = quantized_lm_head(tied, torch.device("cpu"), "w8a8")
    assert isinstance(head, RescoredInt8Head)
    assert head.weight.data_ptr() == embedding.weight.data_ptr()
    assert quantized_lm_head(tied, torch.device("cpu"), "none") is tied
    small = RescoredInt8Head(torch.randn(10, 32))  # fewer tokens than candidates: all exact
    x = torch.randn(2, 32)
    assert torch.allclose(small(x), x @ small.weight.t(), atol=1e-5)
