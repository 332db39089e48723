"""The model's own sampling defaults: what its generation_config.json sets of temperature, top_p,
top_k, repetition_penalty and min_p. As vLLM does by default (`--generation-config auto`), they
apply to the fields a request leaves unset (request_params.py); `generation_config_defaults:
false` keeps the API's own defaults (vLLM's `--generation-config vllm`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from decoding import DecodingParams, DecodingParamsError

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")


def read_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling fields `model_dir/generation_config.json` sets, each with a value a request
    could send (others are left out with a warning). The file is read as written, so a value
    equal to Hugging Face's own default (top_k 50) still counts when the model names it."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): no sampling defaults from it", path, exc)
        return {}
    found = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            DecodingParams(**{name: value})
        except (DecodingParamsError, TypeError):
            log.warning("%s: %s %r is not a valid %s; left out", path, name, value, name)
            continue
        found[name] = value
    return found


def describe(defaults: dict[str, Any], applied: bool) -> str:
    """One line for the start-up log."""
    if not defaults:
        return "the model's generation_config.json sets no sampling defaults"
    listed = ", ".join(f"{k} {v}" for k, v in defaults.items())
    if not applied:
        return f"the model's sampling defaults ({listed}) are off (generation_config_defaults)"
    return (
        f"sampling defaults from the model's generation_config.json: {listed} (for the fields a "
        "request leaves unset)"
    )
