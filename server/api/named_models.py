"""The extra models a request's `model` may name: served by the same engine as the main model, in
its batch, with its tokenizer, chat template and grammars (engine/fusion.py), so only models that
read text as it does: the same vocabulary, token for token (fusion_models.py), and the same ids
ending a sequence, beside a decoder-only served model. Each keeps its own sampling defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from server.api.sampling_defaults import read_sampling_defaults
from server.config import ServerConfig


@dataclass(frozen=True)
class NamedModel:
    """An extra model as a request's `model` sees it."""

    source: str  # its directory
    refusal: str | None  # why requests cannot name it (None: they can)
    sampling_defaults: dict[str, Any]  # its generation_config.json's (sampling_defaults.py)


def named_models(
    config: ServerConfig,
    fusion: dict[str, str | None],
    decoder_only: bool,
    eos_ids: frozenset[int],
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, NamedModel]:
    """Each extra model (a local directory by now) and whether requests can name it: `fusion`
    says which share the served vocabulary; `eos_ids` are the served model's."""
    models = {}
    for name, source in config.extra_model_sources().items():
        path = Path(source)
        why = fusion.get(name)
        if why is None and not decoder_only:
            why = "the served model is an encoder-decoder model"
        if why is None and (theirs := model_eos_ids(path, tokenizer)) != eos_ids:
            why = (
                f"its sequences end at token ids {sorted(theirs)}, the served model's at "
                f"{sorted(eos_ids)}"
            )
        models[name] = NamedModel(source, why, read_sampling_defaults(path))
    return models


def model_eos_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that end a sequence of the model at `model_dir` read with `tokenizer`: its
    generation config's (from config.json when it has none, as transformers loads it) and the
    tokenizer's (model/runner.py's eos_token_ids on the loaded model)."""
    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        loaded = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        generation = GenerationConfig.from_model_config(loaded)
    ids: set[int] = set()
    for value in (generation.eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)
