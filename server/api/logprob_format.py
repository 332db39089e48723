"""OpenAI's two logprobs shapes: legacy completions (parallel lists), chat (one entry a token)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from server.engine.request import TokenLogprob


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    text = tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    assert isinstance(text, str)  # one id list decodes to one string
    return text


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase, entries: list[TokenLogprob], text_offset: int
) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} for `entries`; offsets count
    from `text_offset`."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_dict(tokenizer, e.top) for e in entries],
        "text_offset": offsets,
    }


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
