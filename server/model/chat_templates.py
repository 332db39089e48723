"""Chat templates for models whose files lost theirs (GGUF files often carry none).

Gemma's turn format: `<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n`; it has no
system role, so system text is folded into the first user turn. Generation ends at <end_of_turn>.
"""

from __future__ import annotations

from transformers import GenerationConfig, PreTrainedTokenizerBase

GEMMA_TURN_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system='', pending=true) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + m['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' -}}"
    "{%- if m['role'] != 'assistant' and ns.pending -%}"
    "{{- ns.system -}}{%- set ns.pending = false -%}"
    "{%- endif -%}"
    "{{- m['content'] | trim -}}{{- '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def add_missing_chat_template(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """Give a Gemma-style tokenizer without a template the turn template; the id of
    `<end_of_turn>` if it did (generation then stops there too: `stop_at`), else None."""
    vocab = tokenizer.get_vocab()
    if tokenizer.chat_template or "<start_of_turn>" not in vocab or "<end_of_turn>" not in vocab:
        return None
    tokenizer.chat_template = GEMMA_TURN_TEMPLATE
    return int(vocab["<end_of_turn>"])


def stop_at(generation_config: GenerationConfig, token_id: int) -> None:
    """Add `token_id` to the tokens generation ends at."""
    eos = generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    generation_config.eos_token_id = [*eos_ids, token_id]
