"""OpenAI's two logprobs shapes: legacy completions (parallel lists), chat (one entry a token)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from server.engine.request import TokenLogprob


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    text = tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    assert isinstance(text, str)  # one id list decodes to one string
    return text


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    entries: Sequence[TokenLogprob | None],
    text_offset: int,
    num_top: int | None = None,
) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} of `token_ids`, whose logprobs
    are `entries` (None for a token with nothing before it: an echoed prompt's first, whose
    logprob and alternatives are null, as OpenAI's legacy completions sent them); offsets count
    from `text_offset`; at most `num_top` alternatives each."""
    tokens = [token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [
            None if e is None else _top_dict(tokenizer, e.top[:num_top]) for e in entries
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(
    tokenizer: PreTrainedTokenizerBase, entries: Sequence[TokenLogprob | None], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob",
    "rank", "decoded_token"}} holding the prompt token itself and its `num_top` likeliest
    alternatives."""

    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        scored = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top[:num_top], start=1):
            scored.setdefault(str(token_id), entry(token_id, logprob, rank))
        out.append(scored)
    return out


def _top_dict(tokenizer: PreTrainedTokenizerBase, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy shape keys alternatives by text; tokens that decode alike keep the likeliest."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(token_text(tokenizer, token_id), logprob)
    return out


def _chat_entry(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                **_chat_entry(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_chat_entry(tokenizer, t, lp) for t, lp in e.top],
            }
            for e in entries
        ]
    }
