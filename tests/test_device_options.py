"""Start-up checks of device options: refused or warned about before any model loads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from server.cli import main
from server.model.devices import dtype_warning, quantization_problem
from server.model.runner import ModelRunner


@pytest.mark.parametrize("mode", ["int8", "int8-weights", "w8a8"])
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
