"""Tiny randomly initialised encoder-decoder models of the families beamline serves (BART,
mBART, Marian, Pegasus, M2M100), with the tiny models' trained tokenizer, built offline.

Weights are drawn wider than the families' defaults (`init_std`) so that a random model's output
depends on its source: with the defaults a 32-wide decoder all but ignores it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MarianTokenizer,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    T5Tokenizer,
)

from tests.tiny_models import CORPUS, build_tokenizer

FAMILIES: dict[str, tuple[Any, Any]] = {
    "bart": (BartConfig, BartForConditionalGeneration),
    "mbart": (MBartConfig, MBartForConditionalGeneration),
    "marian": (MarianConfig, MarianMTModel),
    "pegasus": (PegasusConfig, PegasusForConditionalGeneration),
    "m2m_100": (M2M100Config, M2M100ForConditionalGeneration),
    "t5": (T5Config, T5ForConditionalGeneration),
    "mt5": (MT5Config, MT5ForConditionalGeneration),  # T5 v1.1: gated feed-forward, untied
}
# Marian and Pegasus start the decoder from the pad token, the others from EOS (as their
# checkpoints do)
STARTS_FROM_PAD = frozenset({"marian", "pegasus", "t5", "mt5"})


def build_tiny_seq2seq(path: str | Path, family: str, seed: int = 0, tokenizer: Any = None) -> Path:
    """Write a tiny random `family` model plus tokenizer (the tiny models' trained one unless
    given) to `path` and return it."""
    tokenizer = tokenizer or build_tokenizer()
    config_class, model_class = FAMILIES[family]
    start = tokenizer.pad_token_id if family in STARTS_FROM_PAD else tokenizer.eos_token_id
    if family in (
        "t5",
        "mt5",
    ):  # T5 names its sizes its own way; the relative bias: few, near buckets
        config = config_class(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            initializer_factor=3.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=start,
        )
    else:
        config = bart_like(config_class, tokenizer, start)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bart_like(config_class: Any, tokenizer: Any, start: int) -> Any:
    return config_class(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        init_std=0.3,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=start,
        forced_eos_token_id=None,
    )


def build_marian_tokenizer(vocab_size: int = 120) -> MarianTokenizer:
    """Marian's own tokenizer (sentencepiece, Python only: no fast version exists), with its
    two vocabularies (source and target models, one shared id map), trained on the tiny corpus."""
    folder = Path(tempfile.mkdtemp(prefix="marian-spm-"))
    (folder / "corpus.txt").write_text(CORPUS)
    for side in ("source", "target"):
        spm.SentencePieceTrainer.train(
            input=str(folder / "corpus.txt"),
            model_prefix=str(folder / side),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=1.0,
            bos_id=-1,
            eos_id=1,
            unk_id=2,
            pad_id=-1,
            minloglevel=2,
        )
        (folder / f"{side}.model").rename(folder / f"{side}.spm")
    pieces = spm.SentencePieceProcessor(model_file=str(folder / "target.spm"))
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(pieces.get_piece_size()):
        vocab.setdefault(pieces.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    return MarianTokenizer(
        str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json")
    )


def build_t5_tokenizer(vocab_size: int = 120) -> T5Tokenizer:
    """T5's own kind of tokenizer: a sentencepiece Unigram model (pad 0, </s> 1, <unk> 2, words
    split on a metaspace, no byte fallback) trained on the tiny corpus, with a few sentinel
    tokens as T5's checkpoints have them."""
    folder = Path(tempfile.mkdtemp(prefix="t5-spm-"))
    (folder / "corpus.txt").write_text(CORPUS)
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "t5"),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    pieces = spm.SentencePieceProcessor(model_file=str(folder / "t5.model"))
    vocab = [(pieces.id_to_piece(i), pieces.get_score(i)) for i in range(pieces.get_piece_size())]
    return T5Tokenizer(vocab=vocab, extra_ids=4)
