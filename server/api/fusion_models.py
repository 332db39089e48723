"""The extra models a request may fuse into its steps (`lm_fusion`), checked when it arrives."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from transformers import PreTrainedTokenizerBase

from decoding.fusion import LMFusion
from server.api.errors import bad_request
from server.api.openai_model import OpenAIModel
from server.config import ServerConfig
from server.model.loader import default_cache_dir
from server.model.weights import text_config
from server.tokenizer_cache import load_tokenizer

# name -> None when requests can fuse it, else why not (another vocabulary than the served one's)
FusionModels = dict[str, str | None]


class LMFusionField(OpenAIModel):
    """`lm_fusion`: a served extra model whose log-probs are added, times `weight`, to the
    model's at every step (decoding/fusion.py); `plausibility` > 0 keeps only the tokens the
    served model gives at least that times its best token's probability."""

    model: str = Field(min_length=1)
    weight: float = Field(allow_inf_nan=False)
    plausibility: float = Field(0.0, ge=0.0, lt=1.0)


def fusion_models(
    config: ServerConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> FusionModels:
    """Each extra model (a local directory by now) and whether it shares the served model's
    vocabulary: the same number of scores per token and the same token for every id."""
    models: FusionModels = {}
    size = text_config(model_dir).vocab_size
    vocabulary = tokenizer.get_vocab() if config.extra_models else {}
    for name, source in config.extra_model_sources().items():
        other = text_config(Path(source)).vocab_size
        if other != size:
            models[name] = f"its vocabulary has {other} tokens and the served model's {size}"
            continue
        try:
            theirs = load_tokenizer(Path(source), config.cache_dir or default_cache_dir())
        except Exception as exc:  # noqa: BLE001 - any reader's error: it cannot be compared
            models[name] = f"its tokenizer could not be read ({type(exc).__name__}: {exc})"
            continue
        same = theirs.get_vocab() == vocabulary
        models[name] = None if same else "its tokenizer gives other ids to the same tokens"
    return models


def lm_fusion_params(
    models: FusionModels, field: LMFusionField | None, model: str | None = None
) -> LMFusion | None:
    """The request's `lm_fusion` as decoding's LMFusion; a 400 naming `lm_fusion.model` when it
    names no extra model of this server, one with another vocabulary, or the request's own
    `model`."""
    if field is None:
        return None
    if field.model not in models:
        served = ", ".join(sorted(models)) or "none"
        raise bad_request(
            f"lm_fusion.model {field.model!r} is not an extra model of this server (its extra "
            f"models: {served}; `beamline serve --extra-models NAME=SOURCE` loads one)",
            "lm_fusion.model",
            "model_not_found",
        )
    if field.model == model:
        raise bad_request(
            f"lm_fusion.model {field.model!r} is the model the request names: a model is not "
            "fused with itself",
            "lm_fusion.model",
            "invalid_value",
        )
    if (why := models[field.model]) is not None:
        raise bad_request(
            f"lm_fusion.model {field.model!r} cannot be fused with the served model: {why}",
            "lm_fusion.model",
            "vocabulary_mismatch",
        )
    return LMFusion(field.model, field.weight, field.plausibility)
