"""Input scales for w8a8's integer GEMMs (server/model/smoothing.py): an outlier input channel no
longer costs the other channels their precision, rows stay independent of their batch-mates, the
scales are measured on the whole model before it is split, and a row-parallel rank keeps its own
columns' scales."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from server.model.quantization import Int8DynamicLinear, Int8WeightOnlyLinear
from server.model.smoothing import calibrate, calibration_ids, divisor, input_ranges
from server.parallel.shard import ShardedModel
from tests.tiny_models import build_tiny_model


def outlier_inputs(tokens: int = 64, channels: int = 128) -> torch.Tensor:
    """Activations in which two channels run 60x the others (as a normed hidden state does)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, channels, generator=generator)
    x[:, 7] *= 60
    x[:, 90] *= 40
    return x


@torch.inference_mode()
def test_input_scales_move_outlier_channels_into_the_weight() -> None:
    x = outlier_inputs()
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    exact = x @ weight.t()
    plain = Int8DynamicLinear(weight, None)
    smoothed = Int8DynamicLinear(weight, None, divisor=divisor(weight, x.abs().amax(dim=0)))
    plain_error = float((plain(x) - exact).norm() / exact.norm())
    smoothed_error = float((smoothed(x) - exact).norm() / exact.norm())
    assert smoothed_error < plain_error / 3, (smoothed_error, plain_error)
    assert smoothed_error < 0.01
    # the weight it stands for is the float one: scales folded back out
    deviation = (smoothed.dequantized_weight() - weight).norm() / weight.norm()
    assert float(deviation) < 0.03


@torch.inference_mode()
def test_a_smoothed_row_does_not_depend_on_its_batch_mates() -> None:
    x = outlier_inputs(tokens=16)
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    layer = Int8DynamicLinear(weight, None, divisor=divisor(weight, x.abs().amax(dim=0)))
    x[4] *= 100
    alone = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    assert torch.equal(layer(x), alone)


@torch.inference_mode()
def test_calibration_measures_every_smoothed_layers_input(
    tiny_model_dirs: dict[str, Path],
) -> None:
    model_dir = tiny_model_dirs["gemma3"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    divisors = calibrate(decoder, lambda name: name != "down_proj", model_dir, None)
    linears = {m for n, m in decoder.named_modules() if isinstance(m, nn.Linear)}
    downs = {m for n, m in decoder.named_modules() if n.endswith("down_proj")}
    assert downs and set(divisors) == linears - downs
    # each divisor comes from the range its own layer's input took over the bundled text
    ids = calibration_ids(model_dir, None)[:, : model.config.max_position_embeddings]
    assert ids.shape[1] > 100
    seen: dict[nn.Module, torch.Tensor] = {}
    q_proj = decoder.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(
        lambda layer, args: seen.setdefault(layer, args[0].reshape(-1, args[0].shape[-1]))
    )
    model(input_ids=ids, use_cache=False)
    handle.remove()
    expected = divisor(q_proj.weight, seen[q_proj].abs().amax(dim=0))
    assert torch.equal(divisors[q_proj], expected)
    assert torch.equal(input_ranges(model, ids, [q_proj])[q_proj], seen[q_proj].abs().amax(dim=0))


@torch.inference_mode()
def test_calibration_stops_at_the_models_last_position(tmp_path: Path) -> None:
    """The bundled text is longer than a short model's positions: it is cut there (a model with
    learned positions has no embedding past them)."""
    model_dir = build_tiny_model(tmp_path / "short", "gemma3", max_position_embeddings=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    assert calibration_ids(model_dir, None).shape[1] > 64
    tokens: list[int] = []
    q_proj = decoder.layers[0].self_attn.q_proj
    handle = q_proj.register_forward_pre_hook(lambda _l, args: tokens.append(args[0].shape[-2]))
    assert calibrate(decoder, lambda name: True, model_dir, None)
    handle.remove()
    assert tokens == [64]


def test_a_row_parallel_rank_keeps_its_columns_scales() -> None:
    model = nn.ModuleDict({"o_proj": nn.Linear(8, 4), "q_proj": nn.Linear(4, 8)})
    split = ShardedModel(columns={"o_proj": torch.tensor([4, 5, 6, 7])})
    scales = {model["o_proj"]: torch.arange(8.0), model["q_proj"]: torch.arange(4.0)}
    kept = split.kept_columns(model, scales)
    assert torch.equal(kept[model["o_proj"]], torch.tensor([4.0, 5.0, 6.0, 7.0]))
    assert torch.equal(kept[model["q_proj"]], torch.arange(4.0))  # column-parallel: whole


def test_down_proj_stays_weight_only_under_w8a8(tiny_model_dirs: dict[str, Path]) -> None:
    from tests.test_weights_cache import load

    weights = load(tiny_model_dirs["gemma3"], None)
    layer = weights.model.get_decoder().layers[0]
    assert isinstance(layer.mlp.down_proj, Int8WeightOnlyLinear)
    for smoothed in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj):
        assert isinstance(smoothed, Int8DynamicLinear) and smoothed.input_scales is not None
