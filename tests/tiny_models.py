"""Tiny randomly initialised causal LMs with a real (trained here) tokenizer, built offline.

Tests use them so that the engine runs the real transformers model classes in milliseconds.
`python -m tests.tiny_models DIR [ARCH]` writes one to DIR (for subprocess tests and benchmarks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CORPUS = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be or not to be, that is the question. All that glitters is not gold. The early bird
catches the worm. Hello world! How are you today? I am fine, thank you. Once upon a time there was a
little model that served many clients at once. Beam search keeps the best hypotheses at every step.
Sampling draws the next token from the distribution. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Unicode: café, naïve, façade, 東京, 😀, ✓. Code: def f(x): return x * 2 if x > 0 else -x
"""

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

ARCHS: dict[str, dict] = {
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    ),
    "llama": dict(model_type="llama", head_dim=16),
    "qwen2": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=5),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on CORPUS: any text encodes, vocab stays tiny."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | Path, arch: str = "gemma3", seed: int = 0, max_position_embeddings: int = 512
) -> Path:
    """Write a tiny random model of `arch` plus tokenizer to `path` and return it."""
    path = Path(path)
    tokenizer = build_tokenizer()
    extra = dict(ARCHS[arch])
    model_type = extra.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Large weights make next-token distributions peaked, so greedy never hinges on a near-tie.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.35 if "embed" in name else 0.15)
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    out = build_tiny_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gemma3")
    print(out)
