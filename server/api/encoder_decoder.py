"""The front end of an encoder-decoder model (BART, Marian, NLLB, ...): a completion's prompt is
the source, what the model reads; the engine's prompt is that source followed by the decoder's
start token, and the source's length travels with it (engine/request.py `source_len`).

Decoding follows `generate()`: the model's generation config gives the defaults of the fields a
request leaves unset (`defaults`: greedy unless it samples, beams, length penalty, n-gram bans,
minimum length, forced first and last tokens; its bad words; its max_length as the default
max_tokens), unless the server is told not to (`generation_config_defaults` false).

Limits are the model's own: the encoder reads at most `max_source_positions` tokens and the
decoder writes at most `max_target_positions` - 1 (its start takes a position); a request past
either is a 400 naming its field. What has no meaning for a source (echoing it back, its
logprobs) and the chat routes (a translation model has no conversation format) answer a 400 that
says what to use instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, cast

from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from server.api.errors import bad_request
from server.api.openai_model import OpenAIModel
from server.model.architecture import source_and_target_positions

# generation_config.json fields `generate()` applies and beamline does not (start-up names them)
NOT_APPLIED = (
    "encoder_no_repeat_ngram_size",
    "encoder_repetition_penalty",
    "exponential_decay_length_penalty",
    "forced_decoder_ids",
    "suppress_tokens",
    "begin_suppress_tokens",
    "sequence_bias",
    "renormalize_logits",
)
# what `generate()` reads from the generation config, by the DecodingParams field it sets
BEAM_FIELDS = (
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
)
GENERATE_MAX_LENGTH = 20  # generate()'s max_length when the generation config sets none


class LanguageFields(OpenAIModel):
    """A completion's languages on a translation model with language codes (NLLB, M2M100,
    mBART), by the names transformers' translation pipeline gives them."""

    src_lang: str | None = None
    tgt_lang: str | None = None


@dataclass(frozen=True)
class SourceModel:
    """What the front end needs of an encoder-decoder model."""

    decoder_start_token_id: int
    max_source_positions: int
    max_target_positions: int
    # generate()'s defaults from the generation config, as DecodingParams fields, for the fields
    # a request leaves unset; its bad words and its max_length (as new tokens) apart
    defaults: dict[str, Any] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    default_max_tokens: int = GENERATE_MAX_LENGTH - 1
    # what its generation config sets that beamline does not apply (start-up warns)
    not_applied: dict[str, object] = field(default_factory=dict)
    # the tokenizer's language codes and their tokens (NLLB, M2M100, mBART; else none)
    languages: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> SourceModel | None:
        """From the model's config and generation config, or the generation config
        transformers derives from the model's (None: a decoder-only or speech model)."""
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if not getattr(config, "is_encoder_decoder", False) or config.model_type == "whisper":
            return None  # a decoder-only model, or a speech model (server/audio/)
        if (model_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        else:
            generation = GenerationConfig.from_model_config(config)
        written = {k: v for k, v in generation.to_diff_dict().items() if v is not None}
        start = generation.decoder_start_token_id
        if start is None:  # T5's config names none: the decoder starts from its pad token
            start = getattr(config, "decoder_start_token_id", None)
            start = config.pad_token_id if start is None else start
        source, target = source_and_target_positions(config)
        max_new = min(target - 1, int(written.get("max_length", GENERATE_MAX_LENGTH)) - 1)
        return cls(
            int(start),
            source,
            target,
            generate_defaults(written),
            tuple(tuple(word) for word in written.get("bad_words_ids") or ()),
            max(1, max_new),
            {k: written[k] for k in NOT_APPLIED if k in written},
            language_tokens(tokenizer),
        )

    @property
    def max_new_tokens(self) -> int:
        return self.max_target_positions - 1

    def job_prompt(self, source: list[int], param: str = "prompt") -> list[int]:
        """The engine's prompt for `source`, after checking the encoder can read it whole."""
        if len(source) > self.max_source_positions:
            raise bad_request(
                f"{param} is {len(source)} tokens; this encoder-decoder model reads at most "
                f"{self.max_source_positions}",
                param,
                "source_too_long",
            )
        return [*source, self.decoder_start_token_id]

    def check_completion(self, max_tokens: int, echo: bool, prompt_logprobs: bool) -> None:
        """The fields of a completion that do not apply to a source, or ask too much of the
        decoder."""
        if echo:
            raise bad_request(
                "echo is not available for an encoder-decoder model: its prompt is a source the "
                "model reads, not text it continues",
                "echo",
                "unsupported",
            )
        if prompt_logprobs:
            raise bad_request(
                "prompt_logprobs are not available for an encoder-decoder model: the model "
                "reads its source, it does not predict it",
                "prompt_logprobs",
                "unsupported",
            )
        if max_tokens > self.max_new_tokens:
            raise bad_request(
                f"max_tokens is {max_tokens}, and this encoder-decoder model's decoder writes at "
                f"most {self.max_new_tokens} tokens",
                "max_tokens",
                "invalid_value",
            )

    def target_token(self, code: str | None) -> int | None:
        """The token `tgt_lang` forces first (None: no tgt_lang); a 400 listing the codes."""
        if code is None:
            return None
        self._check_language(code, "tgt_lang")
        return self.languages[code]

    @contextlib.contextmanager
    def source_language(
        self, tokenizer: PreTrainedTokenizerBase, code: str | None, text: bool
    ) -> Iterator[None]:
        """Tokenize the source in `src_lang` (the tokenizer's own default without one), as
        transformers' translation pipeline does: the tokenizer's `src_lang` set for the call,
        then put back (requests are tokenized one at a time, on the event loop)."""
        if code is None:
            yield
            return
        self._check_language(code, "src_lang")
        if not text:
            raise bad_request(
                "src_lang applies to a text prompt: token ids already hold their language token",
                "src_lang",
                "invalid_value",
            )
        tokenizer_ = cast(Any, tokenizer)
        before = tokenizer_.src_lang
        tokenizer_.src_lang = code
        try:
            yield
        finally:
            tokenizer_.src_lang = before

    def _check_language(self, code: str, param: str) -> None:
        if not self.languages:
            raise bad_request(no_languages(param), param, "unsupported")
        if code not in self.languages:
            raise bad_request(
                f"{param} {code!r} is not a language code of this model's tokenizer; its codes: "
                f"{', '.join(sorted(self.languages))}",
                param,
                "invalid_value",
            )


def no_languages(param: str) -> str:
    return (
        f"{param} applies to translation models whose tokenizer has language codes (NLLB, "
        "M2M100, mBART); this model's has none"
    )


def language_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Language code -> its token id: M2M100's codes ("en") name tokens ("__en__"); NLLB's and
    mBART's codes are tokens themselves (the special tokens of a tokenizer with a src_lang)."""
    tokenizer_ = cast(Any, tokenizer)
    named = getattr(tokenizer_, "lang_code_to_token", None)
    if named:
        return {code: int(tokenizer_.convert_tokens_to_ids(tok)) for code, tok in named.items()}
    if not hasattr(tokenizer_, "src_lang"):
        return {}
    codes = getattr(tokenizer_, "extra_special_tokens", None) or getattr(
        tokenizer_, "additional_special_tokens", None
    )
    return {str(code): int(tokenizer_.convert_tokens_to_ids(code)) for code in codes or ()}


def generate_defaults(written: dict[str, Any]) -> dict[str, Any]:
    """The DecodingParams fields `generate()` would take from a generation config that sets
    `written`: greedy unless it samples (temperature 0: OpenAI's default would sample), its beam
    fields, `min_length` as new tokens (the decoder's start counts), its forced tokens."""
    defaults: dict[str, Any] = {k: written[k] for k in BEAM_FIELDS if k in written}
    if not written.get("do_sample"):
        defaults["temperature"] = 0.0
    if written.get("min_length", 0) > 1:
        defaults["min_tokens"] = int(written["min_length"]) - 1
    if written.get("forced_bos_token_id") is not None:
        defaults["forced_bos_token_id"] = int(written["forced_bos_token_id"])
    forced_eos = written.get("forced_eos_token_id")
    if forced_eos is not None:
        eos = [forced_eos] if isinstance(forced_eos, int) else list(forced_eos)
        defaults["forced_eos_token_ids"] = tuple(int(t) for t in eos)
    return defaults


def refuse_text() -> NoReturn:
    """The text routes on a speech model."""
    raise bad_request(
        "this is a speech model (Whisper): send audio to /v1/audio/transcriptions or "
        "/v1/audio/translations",
        "model",
        "unsupported_model",
    )


def refuse_chat() -> NoReturn:
    """The chat routes (and the Responses API) on an encoder-decoder model."""
    raise bad_request(
        "this is an encoder-decoder model (translation, summarization): send the source as the "
        "prompt of /v1/completions; it has no chat format",
        "messages",
        "unsupported_model",
    )
