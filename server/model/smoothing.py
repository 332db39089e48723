"""Input scales that let `w8a8`'s integer GEMMs take layers whose inputs carry outlier channels
(SmoothQuant, Xiao et al. 2023).

An integer GEMM quantizes each token with one scale, set by its largest channel. In a language
model a few input channels of a layer are tens of times larger than the rest (Gemma's normed hidden
state, what `q_proj`, `k_proj` and `v_proj` read), so every other channel of that token keeps only
a few of its 8 bits. Dividing input channel j by s_j, and multiplying the weight's column j by
s_j, leaves the product as it was and moves part of the range into the weight, whose scales are
per output channel. With s_j = max|x_j| ** ALPHA / max|W[:, j]| ** (1 - ALPHA), both sides' ranges
meet in the middle. max|x_j| is measured once, at quantization, by one forward of the
floating-point model over a short bundled text (calibration_text.txt: prose, a chat, code, JSON,
several scripts), never the text the accuracy benchmark scores.

The division is a multiply by a per-channel constant that the compiled decode step fuses into the
input's quantization; the weight is quantized already multiplied. The scales are kept with the
int8 weights (weights_cache.py), so a later start neither calibrates nor quantizes.

Measured on Gemma 3 270M while choosing what to smooth (2026-11-29, a script, the fp32 LM head;
perplexity on the accuracy text / on 16k tokens of the docs' guides, fp32 32.02 / 33.23): q/k/v
weight-only and the rest plain integer GEMMs (the previous `w8a8`) 32.30 / 33.58; every layer a
plain integer GEMM 32.88 / 34.39; every layer but `down_proj` smoothed (what `w8a8` now runs)
31.86 / 33.33; `down_proj` smoothed too (ALPHA 0.5 or 0.7 for all; 0.85 or 0.95 for it alone)
32.34-32.75 / 33.52-33.70, so `down_proj` stays weight-only. The served formats' figures are in
docs/guides/tuning.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from server.tokenizer_cache import load_tokenizer

log = logging.getLogger(__name__)

ALPHA = 0.5  # how much of the input's range moves into the weight
CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
CALIBRATION_TOKENS = 1024  # at most: the bundled text is about 900 of Gemma's tokens
SMALLEST = 1e-5  # no channel's range or scale below this (a channel that never fired)


def calibration_ids(model_dir: Path, cache: Path | None) -> torch.Tensor:
    """The bundled calibration text as the model's token ids, [1, tokens]."""
    tokenizer = load_tokenizer(model_dir, cache)
    ids = tokenizer(CALIBRATION_TEXT.read_text()).input_ids[:CALIBRATION_TOKENS]
    return torch.tensor([ids])


@torch.inference_mode()
def input_ranges(
    model: nn.Module, ids: torch.Tensor, layers: list[nn.Linear]
) -> dict[nn.Linear, torch.Tensor]:
    """The largest magnitude each input channel of each of `layers` takes while `model` runs
    over `ids` (float32, [in_features] per layer)."""
    ranges: dict[nn.Linear, torch.Tensor] = {}

    def record(layer: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        known = ranges.get(layer)  # type: ignore[call-overload]
        ranges[layer] = seen if known is None else torch.maximum(known, seen)  # type: ignore[index]

    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def divisor(weight: torch.Tensor, input_range: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [in_features]: the layer's input is divided by it, its weight's columns multiplied."""
    columns = weight.detach().abs().amax(dim=0).float().clamp(min=SMALLEST)
    scaled = input_range.clamp(min=SMALLEST).pow(alpha) / columns.pow(1 - alpha)
    return scaled.clamp(min=SMALLEST)


def calibrate(
    decoder: nn.Module,
    smoothed: Callable[[str], bool],
    model_dir: Path,
    cache: Path | None,
) -> dict[nn.Linear, torch.Tensor]:
    """Each linear layer under `decoder` (a model's, not yet split or quantized) whose attribute
    name `smoothed` accepts, with its divisor, from one forward of the decoder over the bundled
    text."""
    layers = [
        child
        for parent in decoder.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and smoothed(name)
    ]
    if not layers:
        return {}
    config = getattr(decoder, "config", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )  # a model with learned positions has no embedding past them
    ids = calibration_ids(model_dir, cache)[:, : positions or CALIBRATION_TOKENS]
    # the decoder alone: the LM head's logits over the text (0.9 GB for Gemma's 262k-token
    # vocabulary) are not needed
    ranges = input_ranges(decoder, ids, layers)
    log.info("integer GEMMs' input scales measured on %d tokens", ids.shape[1])
    return {layer: divisor(layer.weight, ranges[layer]) for layer in layers if layer in ranges}
