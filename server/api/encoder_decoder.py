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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, GenerationConfig

from server.api.errors import bad_request

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

    @classmethod
    def read(cls, model_dir: Path) -> SourceModel | None:
        """From the model's config and generation config, or the generation config
        transformers derives from the model's (None: a decoder-only model)."""
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if not getattr(config, "is_encoder_decoder", False):
            return None
        if (model_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        else:
            generation = GenerationConfig.from_model_config(config)
        written = {k: v for k, v in generation.to_diff_dict().items() if v is not None}
        start = generation.decoder_start_token_id
        if start is None:
            start = config.decoder_start_token_id
        target = int(config.max_position_embeddings)
        source = int(getattr(config, "max_source_positions", None) or target)
        max_new = min(target - 1, int(written.get("max_length", GENERATE_MAX_LENGTH)) - 1)
        return cls(
            int(start),
            source,
            target,
            generate_defaults(written),
            tuple(tuple(word) for word in written.get("bad_words_ids") or ()),
            max(1, max_new),
            {k: written[k] for k in NOT_APPLIED if k in written},
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


def refuse_chat() -> None:
    """The chat routes (and the Responses API) on an encoder-decoder model."""
    raise bad_request(
        "this is an encoder-decoder model (translation, summarization): send the source as the "
        "prompt of /v1/completions; it has no chat format",
        "messages",
        "unsupported_model",
    )
