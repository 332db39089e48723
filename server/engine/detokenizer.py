"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding token by token breaks multi-byte characters and loses the spaces some tokenizers attach
to the next token. A fast (Rust) tokenizer steps a `tokenizers.decoders.DecodeStream`, which
buffers incomplete byte sequences itself (one call per token, ~0.6 us; what vLLM V1 uses). Other
tokenizers decode a short window of recent tokens and emit only text that is stable: when the
window still ends in U+FFFD (an incomplete byte sequence) they wait for more tokens. Either way,
`flush` surfaces whatever is still held back at the end of a sequence.

Special tokens are left out of the text unless `skip_special_tokens` is False (vLLM's field of the
same name); `spaces_between_special_tokens` reaches slow (sentencepiece) tokenizers only, as in
vLLM: a fast tokenizer has no such option.
"""

from __future__ import annotations

from typing import cast

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

CONTEXT = 6  # earlier tokens decoded with the new ones, for leading-space rules


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        *,
        stream: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        """`stream` False forces the windowed path (tests compare the two)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids: list[int] = self._clean_context(list(prompt_ids[-CONTEXT:]))
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # ids before it have been turned into text
        self.text = ""
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (
            DecodeStream(self.ids, skip_special_tokens=skip_special_tokens)
            if stream and self._backend is not None
            else None
        )

    def _clean_context(self, ids: list[int]) -> list[int]:
        """The longest tail of `ids` that decodes without a broken character: text is cut from
        the decoding of context + new tokens by the context's length, which is only sound when
        the context's bytes do not merge with the new ones (a token-id prompt can end mid-way)."""
        while ids and "\ufffd" in self._decode(ids):
            ids = ids[1:]
        return ids

    def _decode(self, ids: list[int]) -> str:
        return decode_text(
            self.tokenizer, ids, self.skip_special_tokens, self.spaces_between_special_tokens
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the newly stable text (possibly empty)."""
        self.ids.append(token_id)
        if self._stream is not None and self._backend is not None:
            new = self._stream.step(self._backend, token_id)
            if not new:
                return ""
            self.read_offset = len(self.ids)
            self.prefix_offset = max(0, self.read_offset - CONTEXT)
        else:
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
        if self.read_offset == len(self.ids):
            return ""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


def decode_text(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Output ids as text, as a request's fields ask (a fast tokenizer ignores the spacing)."""
    text = tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False,
    )
    return cast(str, text)  # one sequence of ids decodes to one string
