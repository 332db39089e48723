"""Whether beamline can serve a model whole: a model it could only load in part is refused at
start-up, with a message that says why, never served.

transformers loads what it can: `AutoModelForCausalLM` on a BART or Marian directory builds the
decoder alone (BartForCausalLM), reports the encoder's weights as unexpected and its own head as
newly initialized, and the server would then answer from a decoder that never reads the source.
Two checks stop that: the config's kind before anything loads (`check_servable`: a config.json
read, so `beamline serve` ends before its port opens), and the load itself (`check_loaded_whole`:
no weight of the files left unused, none of the model left at its random initial value).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSpeechSeq2Seq,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SHOWN_KEYS = 3  # weight names quoted in a refusal; the count says how many there are
# Encoder-decoder families served whole (model/seq2seq/): BART's, T5's and Whisper's, whose
# decoder layers (self-attention, cross-attention, feed-forward) take their cross-attention keys
# and values from the paged pool
SEQ2SEQ_FAMILIES = frozenset(
    {"bart", "mbart", "marian", "pegasus", "m2m_100", "t5", "mt5", "whisper"}
)


class UnservableModel(ValueError):
    """The model cannot be served whole: the message (one line) says what it is and why."""


def check_servable(model_dir: Path) -> None:
    """UnservableModel unless `model_dir`'s config describes a decoder-only language model
    transformers can build with its head (a multimodal config's text half counts)."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model_type = str(getattr(config, "model_type", "") or "unknown")
    described = f"{model_dir}: model type {model_type!r}{_architectures(config)}"
    if is_seq2seq(config):
        return
    if getattr(config, "is_encoder_decoder", False):
        served = ", ".join(sorted(SEQ2SEQ_FAMILIES))
        raise UnservableModel(
            f"{described} is an encoder-decoder model of a family beamline does not serve yet "
            f"(it serves decoder-only models and the encoder-decoder families {served}): "
            "loading its decoder alone would answer without reading the input"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnservableModel(
            f"{described} has no causal language-model class in transformers "
            "(AutoModelForCausalLM), so beamline cannot generate text with it"
        )


def is_seq2seq(config: Any) -> bool:
    """Whether `config` is an encoder-decoder model of a family beamline serves."""
    return bool(getattr(config, "is_encoder_decoder", False)) and (
        getattr(config, "model_type", None) in SEQ2SEQ_FAMILIES
    )


def auto_model_class(config: Any) -> Any:
    """The transformers auto class that builds a servable model of `config` with its head."""
    if is_seq2seq(config):
        speech = getattr(config, "model_type", None) == "whisper"
        return AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


def source_and_target_positions(config: Any) -> tuple[int, int]:
    """An encoder-decoder model's (source, decoder) positions: its position tables' sizes (T5's
    relative positions have no table: its configs' n_positions, 512 when they name none;
    Whisper's name both sides' own)."""
    size = (
        getattr(config, "max_target_positions", None)
        or getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
    )
    target = int(size or 512)
    return int(getattr(config, "max_source_positions", None) or target), target


def check_loaded_whole(model_dir: Path, loading_info: Mapping[str, Any]) -> None:
    """UnservableModel when transformers' loading info (`output_loading_info=True`) says a weight
    of the files went unused or a weight of the model was not in the files (it would be random);
    a checkpoint of another architecture under a familiar model type loads that way."""
    problems = []
    for key, what in (
        ("missing_keys", "not in the files (they would be random)"),
        ("unexpected_keys", "in the files but unused by the model"),
        ("mismatched_keys", "of another shape in the files"),
    ):
        names = sorted(str(name) for name in loading_info.get(key) or ())
        if names:
            shown = ", ".join(names[:SHOWN_KEYS]) + (", ..." if len(names) > SHOWN_KEYS else "")
            problems.append(f"{len(names)} weights {what} ({shown})")
    if problems:
        raise UnservableModel(
            f"{model_dir}: the model would be served in part: {'; '.join(problems)}"
        )


def _architectures(config: Any) -> str:
    names = getattr(config, "architectures", None) or []
    return f" ({', '.join(names)})" if names else ""
