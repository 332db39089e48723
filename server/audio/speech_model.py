"""What the front end needs of a Whisper model: its special tokens, languages and tasks, the
generation config's suppressed tokens, and how a 30-second window becomes an engine request.

A window's engine prompt is its source, `max_source_positions` placeholder ids that hold the
encoder's positions (model/seq2seq/whisper.py), then the decoder's prompt as transformers'
`generate()` builds it: `<|startoftranscript|>`, the language and the task (multilingual models
only), `<|notimestamps|>` unless timestamps are asked for; conditioning on earlier text puts
`<|startofprev|>` and that text first. The placeholders are one id repeated; what tells the prefix
cache one window's source from another's is the request's cache salt, which carries a digest of
the window's features (`window_salt`), so two uploads of the same audio share their encoder's
blocks and no two different windows ever do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    PreTrainedTokenizerBase,
    WhisperFeatureExtractor,
)

from decoding.timestamps import TimestampRules
from server.audio.features import feature_extractor


@dataclass(frozen=True)
class SpeechModel:
    start_of_transcript: int
    end_of_text: int
    no_timestamps: int
    start_of_previous: int | None
    source_positions: int  # the encoder's output positions of one window (1,500)
    max_target_positions: int  # the decoder's positions, its prompt included (448)
    vocab_size: int  # the model's (the fallback's compression ratio measures token ids in it)
    multilingual: bool
    languages: dict[str, int]  # language code ("en") -> its token
    tasks: dict[str, int]  # "transcribe" / "translate" -> its token
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    max_initial_timestamp_index: int | None
    extractor: WhisperFeatureExtractor = field(compare=False, repr=False)

    @classmethod
    def read(cls, model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> SpeechModel | None:
        """From a Whisper directory's config, generation config and tokenizer (None: not a
        speech model)."""
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        if getattr(config, "model_type", None) != "whisper":
            return None
        if (model_dir / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        else:
            generation = GenerationConfig.from_model_config(config)

        def token(text: str) -> int | None:
            found = tokenizer.convert_tokens_to_ids(text)
            return found if isinstance(found, int) and found != tokenizer.unk_token_id else None

        multilingual = bool(getattr(generation, "is_multilingual", config.vocab_size >= 51865))
        lang_to_id: dict[str, int] = getattr(generation, "lang_to_id", None) or {}
        task_to_id: dict[str, int] = getattr(generation, "task_to_id", None) or {}
        no_timestamps = getattr(generation, "no_timestamps_token_id", None) or token(
            "<|notimestamps|>"
        )
        if no_timestamps is None:
            raise ValueError(f"{model_dir}: a Whisper tokenizer without <|notimestamps|>")
        return cls(
            start_of_transcript=int(generation.decoder_start_token_id),
            end_of_text=int(_first(generation.eos_token_id)),
            no_timestamps=int(no_timestamps),
            start_of_previous=getattr(generation, "prev_sot_token_id", None)
            or token("<|startofprev|>"),
            source_positions=int(config.max_source_positions),
            max_target_positions=int(config.max_target_positions),
            vocab_size=int(config.vocab_size),
            multilingual=multilingual,
            languages={code.strip("<|>"): int(i) for code, i in lang_to_id.items()},
            tasks={str(task): int(i) for task, i in task_to_id.items()},
            suppress_tokens=tuple(int(t) for t in generation.suppress_tokens or ()),
            begin_suppress_tokens=tuple(int(t) for t in generation.begin_suppress_tokens or ()),
            max_initial_timestamp_index=getattr(generation, "max_initial_timestamp_index", None),
            extractor=feature_extractor(model_dir, int(config.num_mel_bins)),
        )

    @property
    def window_tokens(self) -> int:
        """The positions a window's row can take: its source's and the decoder's."""
        return self.source_positions + self.max_target_positions

    @property
    def no_speech(self) -> int:
        """`<|nospeech|>` (`<|nocaptions|>` in English-only vocabularies), as generate() finds it:
        the token before `<|notimestamps|>`."""
        return self.no_timestamps - 1

    def decoder_prompt(
        self, language: str | None, task: str = "transcribe", timestamps: bool = False
    ) -> list[int]:
        """The decoder's prompt of a window, as `generate()` starts it."""
        prompt = [self.start_of_transcript]
        if self.multilingual:
            if language is not None:
                prompt.append(self.languages[language])
            if task in self.tasks:
                prompt.append(self.tasks[task])
        if not timestamps:
            prompt.append(self.no_timestamps)
        return prompt

    def timestamp_rules(self) -> TimestampRules:
        """The rules a window decoded with timestamps follows (decoding/timestamps.py)."""
        return TimestampRules(
            self.no_timestamps + 1,
            self.no_timestamps,
            self.end_of_text,
            self.max_initial_timestamp_index,
        )

    def previous_text(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        """The decoder's prompt before its start for earlier text (`prompt`): `<|startofprev|>`
        and the text's tokens after a space, as transformers' `get_prompt_ids` makes them, kept
        to the last half of the decoder's positions (openai-whisper's limit)."""
        if self.start_of_previous is None:
            return []
        ids = tokenizer(" " + text.strip(), add_special_tokens=False).input_ids
        room = self.max_target_positions // 2 - 1
        return [self.start_of_previous, *ids[max(0, len(ids) - room) :]]

    def engine_prompt(self, decoder_prompt: list[int]) -> list[int]:
        """A window's engine prompt: its source's placeholders, then `decoder_prompt`."""
        return [self.end_of_text] * self.source_positions + decoder_prompt

    def defaults(self) -> dict[str, Any]:
        """The DecodingParams fields `generate()` takes from the generation config: greedy, the
        suppressed tokens (banned as one-token bad words, which is what transformers'
        SuppressTokensLogitsProcessor does) and the first token's suppressed ones."""
        return {
            "temperature": 0.0,
            "bad_words_ids": tuple((t,) for t in self.suppress_tokens),
            "begin_suppress_tokens": self.begin_suppress_tokens,
        }


def window_salt(features: torch.Tensor, salt: str | None = None) -> str:
    """The cache salt of a window: its features' digest (and the client's own salt)."""
    digest = hashlib.sha256(features.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
    return f"{salt or ''}|audio:{digest[:32]}"


def _first(ids: int | list[int]) -> int:
    return ids if isinstance(ids, int) else ids[0]
