"""Start-up checks of device options: refused or warned about before any model loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from server.cli import main
from server.model import devices
from server.model.devices import dtype_warning, quantization_problem, resolve_quantization
from server.model.runner import ModelRunner


@pytest.mark.parametrize("mode", ["int8", "int8-weights", "w8a8", "w8a8-all"])
def test_quantization_on_cuda_is_refused_before_loading(tmp_path: Path, mode: str) -> None:
    """The check comes first: an empty directory (no model at all) still gets this message."""
    with pytest.raises(ValueError, match=f"quantization {mode} runs on the CPU only"):
        ModelRunner(
            tmp_path,
            device=torch.device("cuda"),
            dtype=torch.bfloat16,
            block_size=16,
            num_blocks=8,
            quantization=mode,
        )
    assert quantization_problem("none", torch.device("cuda")) is None
    assert quantization_problem(mode, torch.device("cpu")) is None


def test_cli_refuses_quantization_on_cuda_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cuda", "--quantization", "w8a8"]) == 2
    assert "quantization w8a8 runs on the CPU only" in capsys.readouterr().err


def test_float16_gemma_is_warned_about(
    tiny_model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    assert dtype_warning("gemma3_text", torch.float16) is not None
    assert dtype_warning("gemma3_text", torch.bfloat16) is None
    assert dtype_warning("llama", torch.float16) is None
    with caplog.at_level(logging.WARNING, logger="server.model.runner"):
        ModelRunner(
            tiny_model_dirs["gemma3"],
            device=torch.device("cpu"),
            dtype=torch.float16,
            block_size=4,
            num_blocks=8,
        )
    assert any("overflow float16" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("flags", "dtype", "device", "want"),
    [
        ({"avx512_vnni", "avx512f"}, "auto", "cpu", "w8a8"),
        ({"amx_int8"}, "auto", "cpu", "w8a8"),
        ({"avx2"}, "auto", "cpu", "none"),  # no int8 dot products: int8 GEMMs are no faster
        ({"avx512_vnni"}, "float32", "cpu", "none"),  # an explicit dtype is that precision
        ({"avx512_vnni"}, "bfloat16", "cpu", "none"),
        ({"avx512_vnni"}, "auto", "cuda", "none"),
    ],
)
def test_quantization_auto_is_w8a8_only_on_cpus_with_int8_dot_products(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], dtype: str, device: str, want: str
) -> None:
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset(flags))
    assert resolve_quantization("auto", dtype, torch.device(device)) == want
    assert resolve_quantization("int8", dtype, torch.device(device)) == "int8"  # as given
    assert quantization_problem("auto", torch.device("cuda")) is None


def test_the_cpu_flags_are_read() -> None:
    flags = devices.cpu_flags()
    if Path("/proc/cpuinfo").is_file() and "flags" in Path("/proc/cpuinfo").read_text():
        assert "fpu" in flags or "sse2" in flags
