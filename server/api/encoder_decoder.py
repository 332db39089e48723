"""The front end of an encoder-decoder model (BART, Marian, NLLB, ...): a completion's prompt is
the source, what the model reads; the engine's prompt is that source followed by the decoder's
start token, and the source's length travels with it (engine/request.py `source_len`).

Limits are the model's own: the encoder reads at most `max_source_positions` tokens and the
decoder writes at most `max_target_positions` - 1 (its start takes a position); a request past
either is a 400 naming its field. What has no meaning for a source (echoing it back, its
logprobs) and the chat routes (a translation model has no conversation format) answer a 400 that
says what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from server.api.errors import bad_request

# generation_config.json fields `generate()` applies to an encoder-decoder model and beamline
# does not yet: a request sets the decoding fields itself (num_beams, length_penalty, ...)
NOT_APPLIED = (
    "forced_bos_token_id",
    "forced_eos_token_id",
    "num_beams",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "max_length",
)


@dataclass(frozen=True)
class SourceModel:
    """What the front end needs of an encoder-decoder model."""

    decoder_start_token_id: int
    max_source_positions: int
    max_target_positions: int
    # what its generation config sets that beamline does not apply (start-up warns)
    not_applied: dict[str, object] = field(default_factory=dict)

    @classmethod
    def read(cls, model_dir: Path) -> SourceModel | None:
        """From the model's config (None: a decoder-only model). The decoder's start is the
        generation config's, as `generate()` takes it, else the model config's."""
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if not getattr(config, "is_encoder_decoder", False):
            return None
        start, not_applied = None, {}
        if (model_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
            start = generation.decoder_start_token_id
            written = generation.to_diff_dict()
            not_applied = {k: written[k] for k in NOT_APPLIED if written.get(k) is not None}
        if start is None:
            start = config.decoder_start_token_id
        target = int(config.max_position_embeddings)
        source = int(getattr(config, "max_source_positions", None) or target)
        return cls(int(start), source, target, not_applied)

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


def refuse_chat() -> None:
    """The chat routes (and the Responses API) on an encoder-decoder model."""
    raise bad_request(
        "this is an encoder-decoder model (translation, summarization): send the source as the "
        "prompt of /v1/completions; it has no chat format",
        "messages",
        "unsupported_model",
    )
