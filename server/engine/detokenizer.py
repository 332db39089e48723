"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding token by token breaks multi-byte characters and loses the spaces some tokenizers attach
to the next token, so we decode a short window of recent tokens and emit only text that is stable:
when the window still ends in U+FFFD (an incomplete byte sequence) we wait for more tokens.
"""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context for leading-space rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return cast(str, text)  # one sequence of ids decodes to one string

    def push(self, token_id: int) -> str:
        """Add one token; return the newly stable text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a sequence, emit whatever is still held back."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new
