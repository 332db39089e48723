"""Random-weight encoder-decoder models of public checkpoints' shapes, with a word-level
tokenizer of exactly their vocabulary, so that beamline, CTranslate2 (through its converter) and
transformers all load the same model and every id decodes.

The special tokens sit where the checkpoints have them, because CTranslate2's converters read them
from there: Marian (opus-mt) has `</s>` = 0, `<unk>` = 1 and `<pad>` = the last id (the decoder
starts from it; CTranslate2 drops it from the vocabulary and starts from a zero embedding, which the
pad row is); T5 has `<pad>` = 0 (the decoder's start), `</s>` = 1, `<unk>` = 2.

The generation config is what both peers do without being told: no forced EOS (CTranslate2 has no
such rule) and, for Marian, the pad token never generated (CTranslate2's vocabulary lacks it; the
opus-mt checkpoints ship the same bad word).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

from benchmarks.random_models import word_of

MARIAN = dict(d_model=512, layers=6, heads=8, ffn=2048, vocab_size=58101)  # opus-mt-en-de
SHAPES: dict[str, dict[str, Any]] = {
    "marian": dict(family="marian", **MARIAN),
    "t5-base": dict(family="t5", d_model=768, layers=12, heads=12, ffn=3072, vocab_size=32128),
    # for the benchmark's own test
    "tiny-marian": dict(family="marian", d_model=32, layers=2, heads=4, ffn=64, vocab_size=512),
    "tiny-t5": dict(family="t5", d_model=32, layers=2, heads=4, ffn=64, vocab_size=512),
}


def word_level_tokenizer(specials: dict[int, str], vocab_size: int) -> PreTrainedTokenizerFast:
    """`specials` at their ids, one word (`word_of(id)`) at every other id; split on spaces."""
    vocab = {specials.get(i, word_of(i)): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials_named(specials, "unk")))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=specials_named(specials, "/s"),
        pad_token=specials_named(specials, "pad"),
        unk_token=specials_named(specials, "unk"),
    )


def specials_named(specials: dict[int, str], name: str) -> str:
    return next(token for token in specials.values() if name in token)


def build_translation_model(shape: str, root: Path, seed: int = 0) -> Path:
    """Write the `shape` model (see SHAPES) with its tokenizer under `root` once; return its
    directory."""
    path = root / shape
    if (path / "config.json").exists():
        return path
    spec = SHAPES[shape]
    size = int(spec["vocab_size"])
    torch.manual_seed(seed)
    if spec["family"] == "marian":
        tokenizer = word_level_tokenizer({0: "</s>", 1: "<unk>", size - 1: "<pad>"}, size)
        pad, eos = size - 1, 0
        config: Any = MarianConfig(
            vocab_size=size,
            d_model=spec["d_model"],
            encoder_layers=spec["layers"],
            decoder_layers=spec["layers"],
            encoder_attention_heads=spec["heads"],
            decoder_attention_heads=spec["heads"],
            encoder_ffn_dim=spec["ffn"],
            decoder_ffn_dim=spec["ffn"],
            activation_function="swish",
            max_position_embeddings=512,
            scale_embedding=True,
            pad_token_id=pad,
            eos_token_id=eos,
            decoder_start_token_id=pad,
            forced_eos_token_id=None,
        )
        model: Any = MarianMTModel(config)
        bad_words: list[list[int]] | None = [[pad]]
    else:
        tokenizer = word_level_tokenizer({0: "<pad>", 1: "</s>", 2: "<unk>"}, size)
        pad, eos = 0, 1
        config = T5Config(
            vocab_size=size,
            d_model=spec["d_model"],
            d_kv=spec["d_model"] // spec["heads"],
            d_ff=spec["ffn"],
            num_layers=spec["layers"],
            num_decoder_layers=spec["layers"],
            num_heads=spec["heads"],
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            pad_token_id=pad,
            eos_token_id=eos,
            decoder_start_token_id=pad,
        )
        model = T5ForConditionalGeneration(config)
        bad_words = None
    model.generation_config = GenerationConfig(
        decoder_start_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        bad_words_ids=bad_words,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
