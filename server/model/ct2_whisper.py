"""faster-whisper's model directories (CTranslate2's format) read into transformers' Whisper.

faster-whisper ships Whisper as a CTranslate2 directory: `model.bin` (every weight, CTranslate2's
binary format; or its parts, `model.bin.part1` and on, where a package index's size limit split it),
`config.json` (the generation config's suppressed tokens, language ids and alignment heads, no model
description), `tokenizer.json` (Hugging Face's Whisper tokenizer) and `vocabulary.txt`. The first
start reads it into a transformers Whisper directory under the cache (safetensors, config,
generation config, tokenizer, feature extractor) as the GGUF path does; every later start loads that
directory.

CTranslate2's format, version 6 (what `ctranslate2.specs.ModelSpec` writes; older versions are
refused): a uint32 version, the spec's name and revision, then each variable as its name, rank,
dims, a type id (float32, int8, int16, int32, float16, bfloat16), a byte count and the bytes, then
aliases (name -> name). Its Whisper spec fuses the self-attention's query, key and value
projections into one layer (`linear_0`; Whisper's key projection has no bias, stored as zeros) and
the cross-attention's key and value (`linear_1`); an int8 model keeps a `weight_scale` per output
row (weights = int8 values / scale).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from server.model.conversions import file_key, rename_into_place

log = logging.getLogger(__name__)

CONVERSION_VERSION = 1  # bump when `convert` changes what it writes
BINARY_VERSION = 6
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")
TASKS = ("transcribe", "translate")
PART = re.compile(r"model\.bin\.part(\d+)")


class NotCTranslate2Whisper(ValueError):
    """The directory is not a CTranslate2 Whisper model beamline can read."""


def model_bin_parts(path: Path) -> list[Path]:
    """The files of the directory's `model.bin`: itself, or the parts it was split into for a
    package index's size limit (`model.bin.part1`, `model.bin.part2`, ...), in order; none if
    there is neither."""
    if (path / "model.bin").is_file():
        return [path / "model.bin"]
    numbered = ((PART.fullmatch(p.name), p) for p in path.glob("model.bin.part*") if p.is_file())
    parts = {int(match.group(1)): p for match, p in numbered if match}
    if not parts:
        return []
    if sorted(parts) != list(range(1, len(parts) + 1)):
        raise NotCTranslate2Whisper(
            f"{path}: model.bin parts {sorted(parts)}; they must run from 1 without a gap"
        )
    return [parts[n] for n in sorted(parts)]


def is_ct2_whisper(path: Path) -> bool:
    """Whether `path` is a CTranslate2 Whisper directory (faster-whisper's format)."""
    if not model_bin_parts(path) or not (path / "config.json").is_file():
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_ct2_whisper_config(config)


def is_ct2_whisper_config(config: object) -> bool:
    """Whether a `config.json` is a CTranslate2 Whisper model's (no model type; its generation
    settings instead)."""
    if not isinstance(config, dict) or "model_type" in config:
        return False
    return "suppress_ids" in config or "lang_ids" in config


def read_model_bin(parts: list[Path]) -> tuple[str, dict[str, torch.Tensor]]:
    """The spec's name and every variable of a CTranslate2 `model.bin` (aliases resolved), from
    its file or its parts."""
    data = b"".join(part.read_bytes() for part in parts)
    path = parts[0]
    at = 0

    def take(fmt: str) -> int:
        nonlocal at
        (value,) = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize(fmt)
        return int(value)

    def text() -> str:
        nonlocal at
        size = take("H")  # with its trailing NUL
        value = data[at : at + size - 1].decode("utf-8")
        at += size
        return value

    version = take("I")
    if version != BINARY_VERSION:
        raise NotCTranslate2Whisper(
            f"{path}: CTranslate2 binary version {version}; beamline reads version "
            f"{BINARY_VERSION} (CTranslate2 4.x): convert the model again with "
            "ct2-transformers-converter"
        )
    spec = text()
    take("I")  # the spec's revision
    variables: dict[str, torch.Tensor] = {}
    for _ in range(take("I")):
        name = text()
        shape = [take("I") for _ in range(take("B"))]
        kind, size = take("B"), take("I")
        raw = data[at : at + size]
        at += size
        variables[name] = _tensor(raw, kind, shape)
    for _ in range(take("I")):
        alias, target = text(), text()
        variables[alias] = variables[target]
    return spec, variables


def _tensor(raw: bytes, kind: int, shape: list[int]) -> torch.Tensor:
    dtype = DTYPES[kind]
    if dtype == "bfloat16":
        values = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(values.view(np.float32).reshape(shape).copy())
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(shape).copy())


def _weight(variables: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A layer's float weight (an int8 one divided by its output channels' scales)."""
    weight = variables[f"{prefix}/weight"]
    scale = variables.get(f"{prefix}/weight_scale")
    if weight.dtype == torch.int8:
        if scale is None:
            raise NotCTranslate2Whisper(f"{prefix}: an int8 weight without its scale")
        return weight.float() / scale.float().view(-1, *[1] * (weight.dim() - 1))
    return weight


def _linear(out: dict[str, torch.Tensor], variables: dict[str, torch.Tensor], src: str, dst: str):
    out[f"{dst}.weight"] = _weight(variables, src)
    if f"{src}/bias" in variables:
        out[f"{dst}.bias"] = variables[f"{src}/bias"]


def _norm(out: dict[str, torch.Tensor], variables: dict[str, torch.Tensor], src: str, dst: str):
    out[f"{dst}.weight"] = variables[f"{src}/gamma"]
    out[f"{dst}.bias"] = variables[f"{src}/beta"]


def _split(
    out: dict[str, torch.Tensor],
    variables: dict[str, torch.Tensor],
    src: str,
    names: tuple[str, ...],
) -> None:
    """A fused projection's parts, in order (a key projection's bias, zeros, is dropped)."""
    weights = _weight(variables, src).chunk(len(names))
    biases = variables[f"{src}/bias"].chunk(len(names))
    for name, weight, bias in zip(names, weights, biases):
        out[f"{name}.weight"] = weight
        if not name.endswith("k_proj"):
            out[f"{name}.bias"] = bias


def _count(variables: dict[str, torch.Tensor], prefix: str) -> int:
    parts = (name.split("/") for name in variables if name.startswith(f"{prefix}/layer_"))
    return len({part[1] for part in parts if part[1].removeprefix("layer_").isdigit()})


Variables = dict[str, torch.Tensor]


def hf_whisper(variables: Variables) -> tuple[dict[str, Any], Variables]:
    """WhisperConfig's sizes and transformers' state dict of a CTranslate2 Whisper's variables."""
    encoder_layers, decoder_layers = _count(variables, "encoder"), _count(variables, "decoder")
    embeddings = _weight(variables, "decoder/embeddings")
    d_model = embeddings.shape[1]
    sizes = {
        "vocab_size": embeddings.shape[0],
        "d_model": d_model,
        "encoder_layers": encoder_layers,
        "decoder_layers": decoder_layers,
        "encoder_attention_heads": int(variables["encoder/num_heads"]),
        "decoder_attention_heads": int(variables["decoder/num_heads"]),
        "encoder_ffn_dim": variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        "decoder_ffn_dim": variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        "num_mel_bins": variables["encoder/conv1/weight"].shape[1],
        "max_source_positions": variables["encoder/position_encodings/encodings"].shape[0],
        "max_target_positions": variables["decoder/position_encodings/encodings"].shape[0],
    }
    out: dict[str, torch.Tensor] = {}
    for conv in ("conv1", "conv2"):
        out[f"model.encoder.{conv}.weight"] = _weight(variables, f"encoder/{conv}")
        out[f"model.encoder.{conv}.bias"] = variables[f"encoder/{conv}/bias"]
    for side in ("encoder", "decoder"):
        here = f"model.{side}"
        out[f"{here}.embed_positions.weight"] = variables[f"{side}/position_encodings/encodings"]
        _norm(out, variables, f"{side}/layer_norm", f"{here}.layer_norm")
        for i in range(encoder_layers if side == "encoder" else decoder_layers):
            src, dst = f"{side}/layer_{i}", f"{here}.layers.{i}"
            qkv = tuple(f"{dst}.self_attn.{p}_proj" for p in "qkv")
            _split(out, variables, f"{src}/self_attention/linear_0", qkv)
            _linear(out, variables, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            _norm(out, variables, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            _linear(out, variables, f"{src}/ffn/linear_0", f"{dst}.fc1")
            _linear(out, variables, f"{src}/ffn/linear_1", f"{dst}.fc2")
            _norm(out, variables, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            if side == "decoder":
                cross = f"{dst}.encoder_attn"
                _linear(out, variables, f"{src}/attention/linear_0", f"{cross}.q_proj")
                kv = (f"{cross}.k_proj", f"{cross}.v_proj")
                _split(out, variables, f"{src}/attention/linear_1", kv)
                _linear(out, variables, f"{src}/attention/linear_2", f"{cross}.out_proj")
                _norm(out, variables, f"{src}/attention/layer_norm", f"{cross}_layer_norm")
    out["model.decoder.embed_tokens.weight"] = embeddings
    return sizes, out


def conversion_dir(model_dir: Path, cache_dir: Path) -> Path:
    """Where the transformers copy of a CTranslate2 Whisper directory is kept (one per file)."""
    keys = [file_key(part) for part in model_bin_parts(model_dir)]
    key = keys[0] if len(keys) == 1 else hashlib.sha256("".join(keys).encode()).hexdigest()[:12]
    return cache_dir / f"{model_dir.resolve().name}-{key}-ct2-v{CONVERSION_VERSION}"


def convert(model_dir: Path, target: Path) -> None:
    """Write the transformers Whisper directory of CTranslate2 directory `model_dir` to `target`,
    atomically (a folder of this process's own, renamed into place; the first to finish wins)."""
    from safetensors.torch import save_file
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperTokenizer

    spec, variables = read_model_bin(model_bin_parts(model_dir))
    if spec != "WhisperSpec":
        raise NotCTranslate2Whisper(f"{model_dir}: a CTranslate2 {spec}, not a Whisper model")
    if not (model_dir / "tokenizer.json").is_file():
        raise NotCTranslate2Whisper(f"{model_dir}: no tokenizer.json beside model.bin")
    settings = json.loads((model_dir / "config.json").read_text())
    sizes, weights = hf_whisper(variables)
    floats = {w.dtype for w in weights.values()}
    dtype = torch.float16 if floats == {torch.float16} else torch.float32
    weights = {name: w.to(dtype).contiguous() for name, w in weights.items()}
    # CTranslate2 stores equal tensors once (aliases), and a fused layer's parts are views of
    # it: safetensors writes no two tensors of one storage
    seen: set[int] = set()
    for name, weight in weights.items():
        storage = weight.untyped_storage().data_ptr()
        if (
            storage in seen
            or weight.numel() != weight.untyped_storage().nbytes() // weight.element_size()
        ):
            weights[name] = weight = weight.clone()
        seen.add(weight.untyped_storage().data_ptr())
    tokenizer = WhisperTokenizer(tokenizer_file=str(model_dir / "tokenizer.json"))
    ids = {t: int(cast(int, tokenizer.convert_tokens_to_ids(t))) for t in _SPECIAL}
    config = WhisperConfig(
        **sizes,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        dtype=str(dtype).removeprefix("torch."),
        architectures=["WhisperForConditionalGeneration"],
    )
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "generation_config.json").write_text(
        json.dumps(generation_config(settings, sizes, tokenizer, ids), indent=1) + "\n"
    )
    tokenizer.save_pretrained(tmp)
    WhisperFeatureExtractor(feature_size=sizes["num_mel_bins"]).save_pretrained(tmp)
    rename_into_place(tmp, target)


_SPECIAL = (
    "<|startoftranscript|>",
    "<|endoftext|>",
    "<|notimestamps|>",
    "<|startofprev|>",
    "<|transcribe|>",
    "<|translate|>",
)


def generation_config(
    settings: dict[str, Any], sizes: dict[str, Any], tokenizer: Any, ids: dict[str, int]
) -> dict[str, Any]:
    """The generation config a Whisper checkpoint on the hub carries, from faster-whisper's
    config.json (suppressed tokens, language ids, alignment heads) and the tokenizer."""
    lang_ids = [int(i) for i in settings.get("lang_ids") or ()]
    multilingual = sizes["vocab_size"] >= 51865
    config: dict[str, Any] = {
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "suppress_tokens": [int(t) for t in settings.get("suppress_ids") or ()],
        "begin_suppress_tokens": [int(t) for t in settings.get("suppress_ids_begin") or ()],
        "max_initial_timestamp_index": 50,
        "max_length": sizes["max_target_positions"],
        "is_multilingual": multilingual,
    }
    if settings.get("alignment_heads"):
        config["alignment_heads"] = [list(map(int, h)) for h in settings["alignment_heads"]]
    if multilingual:
        config["lang_to_id"] = {tokenizer.convert_ids_to_tokens(i): i for i in lang_ids}
        config["task_to_id"] = {task: ids[f"<|{task}|>"] for task in TASKS}
    return config
