"""Random-weight causal LMs built from a config, for speed measurements where no weights exist.

A GPU machine here has no network and takes no more than tens of MiB in, so the GPU benchmarks
build Llama-3.2-1B- and Llama-3.1-8B-shaped models on the device itself (a CPU initialisation of
8B parameters takes minutes). Random weights are fine for speed (requests use `ignore_eos`) and
for parity against transformers' own `generate()` on the same weights. The tokenizer is a
word-level one with exactly the model's vocabulary, so every id a random model picks decodes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# Shapes of the public checkpoints (their config.json), vocabulary included.
SHAPES: dict[str, dict[str, object]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
}
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def word_of(token_id: int) -> str:
    """`w` and the id in base 26, as letters: byte-level pre-tokenizers split off digits."""
    letters = ""
    while True:
        token_id, digit = divmod(token_id, 26)
        letters = chr(ord("a") + digit) + letters
        if not token_id:
            return "w" + letters


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level: ids 0-3 are the special tokens, then the 256 bytes, then one word per id
    (` ` + `word_of(id)`), so every id decodes and grammar engines (llguidance) recognise the
    decoder; text of other words encodes as <unk>."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({ch: len(SPECIALS) + i for i, ch in enumerate(sorted(alphabet))})
    first_word = len(vocab)
    vocab.update({"\u0120" + word_of(i): i for i in range(first_word, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_random_model(
    path: str | Path,
    shape: str = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Path:
    """Write a random Llama of `shape` (see SHAPES) and its tokenizer to `path`; return it."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = word_tokenizer(int(SHAPES[shape]["vocab_size"]))  # type: ignore[call-overload]
    config = AutoConfig.for_model(
        "llama",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=shape != "llama-8b",
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
