"""The int8 layers kept between starts (server/model/weights_cache.py): a later start reads them
instead of quantizing, the floating-point weights prompt scoring reads are memory-mapped from the
entry, and an entry that cannot be read or written costs a warning, never a wrong model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import server.model.weights as weights
import server.model.weights_cache as weights_cache
from server.model.exact_weights import ExactWeights
from server.model.int8_products import onednn_int8_works
from server.model.quantization import Int8Linear
from server.model.weights import ServingWeights, load_serving_weights
from tests.engine_driver import Counted


def load(model_dir: Path, cache: Path | None, quantization: str = "w8a8") -> ServingWeights:
    return load_serving_weights(
        model_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        quantization=quantization,
        linear_layout="native",
        compiled=False,
        max_loras=0,
        max_lora_rank=16,
        tp=None,
        weights_cache=cache,
    )


@pytest.fixture
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["gemma3"]


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> Counted:
    """The input scales' measurement (smoothing.py), counted."""
    calibrate = Counted(weights.calibrate)
    monkeypatch.setattr(weights, "calibrate", calibrate)
    return calibrate


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counted:
    """The weights cache's quantizer, counting the layers it quantizes."""
    quantize = Counted(weights_cache.quantize_per_channel)
    monkeypatch.setattr(weights_cache, "quantize_per_channel", quantize)
    return quantize


def int8_state(weights: ServingWeights) -> dict[str, torch.Tensor]:
    return {
        name: tensor
        for name, layer in weights.model.named_modules()
        if isinstance(layer, Int8Linear)
        for name, tensor in (
            (f"{name}.q", layer.weight_int8),
            (f"{name}.s", layer.scales),
            (f"{name}.d", getattr(layer, "input_scales", None)),
        )
        if tensor is not None
    }


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def exact_equal(a: ExactWeights, b: ExactWeights) -> bool:
    return len(a) == len(b) > 0 and all(
        torch.equal(x, y) for x, y in zip(a.weights.values(), b.weights.values(), strict=True)
    )


def logits_of(weights: ServingWeights, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = weights.model.get_decoder()(torch.tensor([ids])).last_hidden_state
        return weights.lm_head(hidden[0])


def test_a_later_start_reads_the_int8_layers_instead_of_quantizing(
    model_dir: Path,
    tmp_path: Path,
    counted: Counted,
    calibrations: Counted,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = load(model_dir, None)
    made = counted.calls
    assert made > 1  # every decoder layer and the head
    assert calibrations.calls == 1
    caplog.set_level(logging.INFO)
    first = load(model_dir, tmp_path)
    assert counted.calls == 2 * made and calibrations.calls == 2
    (entry,) = tmp_path.glob("*.pt")
    assert "int8 weights kept for later starts" in caplog.text
    caplog.clear()
    later = load(model_dir, tmp_path)
    assert counted.calls == 2 * made  # nothing quantized again
    assert calibrations.calls == 2  # nor measured: the input scales are the entry's
    assert f"int8 weights of {made} layers read from {entry}" in caplog.text
    for state in (int8_state(first), int8_state(later)):
        assert state.keys() == int8_state(plain).keys()
        assert all(torch.equal(t, int8_state(plain)[k]) for k, t in state.items())
    assert any(name.endswith(".d") for name in int8_state(later))  # the input scales too
    ids = [2, 17, 5, 40, 33, 8]
    torch.testing.assert_close(logits_of(later, ids), logits_of(plain, ids), atol=0, rtol=0)
    # the floating-point weights: the model's own, mapped from the entry's file on both starts
    assert exact_equal(plain.exact, first.exact) and exact_equal(plain.exact, later.exact)
    assert str(entry) in mapped_files()


def test_an_unreadable_entry_is_quantized_again_and_written_anew(
    model_dir: Path, tmp_path: Path, counted: Counted, caplog: pytest.LogCaptureFixture
) -> None:
    load(model_dir, tmp_path)
    (entry,) = tmp_path.glob("*.pt")
    entry.write_bytes(entry.read_bytes()[:1000])
    made = counted.calls
    again = load(model_dir, tmp_path)
    assert "cannot read the cached int8 weights" in caplog.text
    assert counted.calls == 2 * made
    later = load(model_dir, tmp_path)  # the rewritten entry reads
    assert counted.calls == 2 * made
    assert exact_equal(again.exact, later.exact)


def test_a_cache_that_cannot_be_written_keeps_the_weights_in_memory(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    weights = load(model_dir, blocked / "weights")
    assert "cannot keep the int8 weights" in caplog.text
    assert exact_equal(weights.exact, load(model_dir, None).exact)


def test_changed_weight_files_or_another_format_take_another_entry(
    model_dir: Path, tmp_path: Path
) -> None:
    form = {"quantization": "w8a8", "dtype": "torch.float32", "tensor_parallel": "none"}
    entry = weights_cache.weights_entry(tmp_path, model_dir, form)
    assert weights_cache.weights_entry(tmp_path, model_dir, form) == entry
    other = weights_cache.weights_entry(tmp_path, model_dir, {**form, "quantization": "w8a8-all"})
    assert other != entry
    (weights,) = model_dir.glob("*.safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert weights_cache.weights_entry(tmp_path, model_dir, form) != entry
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_head_only_format_keeps_no_floating_point_copy(
    model_dir: Path, tmp_path: Path, counted: Counted
) -> None:
    """`int8` quantizes the LM head alone: the decoder is the floating-point model already. The
    cache keeps the head's int8 weights for oneDNN's product; fbgemm's (where oneDNN's int8
    linear does not run) quantizes its own."""
    cached = 1 if onednn_int8_works() else 0
    weights = load(model_dir, tmp_path, "int8")
    assert len(weights.exact) == 0 and counted.calls == cached
    load(model_dir, tmp_path, "int8")
    assert counted.calls == cached
