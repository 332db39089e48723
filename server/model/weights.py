"""The served model's weights in their serving form: loaded, split across tensor-parallel ranks,
quantized, laid out for the CPU, wrapped for LoRA adapters, in that order (each step sees the
layers the one before left)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, PreTrainedModel

from server.model.architecture import (
    auto_model_class,
    check_loaded_whole,
    check_servable,
    is_seq2seq,
)
from server.model.cpu_linear import apply_linear_layout
from server.model.devices import dtype_warning
from server.model.exact_weights import ExactWeights, int8_layers
from server.model.lora.files import target_modules
from server.model.lora.modules import LoRAModules
from server.model.quantization import (
    WEIGHT_ONLY,
    WEIGHT_ONLY_UNSMOOTHED,
    quantize_decoder_weights,
    quantize_w8a8,
    quantized_lm_head,
)
from server.model.smoothing import calibrate
from server.model.weights_cache import Layers, Quantizer, load_layers, save_layers, weights_entry
from server.parallel.group import TPGroup
from server.parallel.shard import reduce_row_parallel, shard_model

log = logging.getLogger(__name__)


def text_config(model_dir: Path) -> Any:
    """The model's text config (a multimodal config's language half)."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return getattr(config, "text_config", config)


@dataclass
class ServingWeights:
    model: PreTrainedModel
    lm_head: torch.nn.Module
    vocab_size: int  # the whole vocabulary's, also under tensor parallelism
    linear_layout: str
    lora: LoRAModules | None
    exact: ExactWeights  # the int8 layers' floating-point weights, for prompt scoring


def load_serving_weights(
    model_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str,
    linear_layout: str,
    compiled: bool,
    max_loras: int,
    max_lora_rank: int,
    tp: TPGroup | None,
    weights_cache: Path | None = None,
) -> ServingWeights:
    """`weights_cache`: where a quantized model's int8 layers are kept between starts
    (weights_cache.py); None: quantized at every start, floating-point weights kept in memory."""
    check_servable(model_dir)
    config = text_config(model_dir)
    if (warning := dtype_warning(str(config.model_type), dtype)) is not None:
        log.warning(warning)
    # On an accelerator the weights load straight onto it (no copy through host RAM), unless
    # they are split first: then each rank moves its share only.
    placement = {"device_map": str(device)} if device.type != "cpu" and tp is None else {}
    auto_class = auto_model_class(config)
    loaded = auto_class.from_pretrained(
        model_dir,
        dtype=dtype,
        local_files_only=True,
        trust_remote_code=False,
        output_loading_info=True,
        **placement,
    )
    # with output_loading_info, (model, info); transformers' stub types the model alone
    model, loading_info = cast(tuple[PreTrainedModel, dict[str, Any]], loaded)
    check_loaded_whole(model_dir, loading_info)
    model.eval()
    lora_targets = target_modules(model)  # whole shapes, before splitting and quantization
    vocab_size = model.get_output_embeddings().weight.shape[0]
    entry = None
    if weights_cache is not None and quantization != "none":
        ranks = f"rank {tp.rank} of {tp.size}" if tp else "none"
        form = {"quantization": quantization, "dtype": str(dtype), "tensor_parallel": ranks}
        entry = weights_entry(weights_cache, model_dir, form)
    stored = load_layers(entry) if entry is not None else None
    divisors = {}  # the input scales of w8a8's integer layers, measured on the whole model
    if quantization == "w8a8" and stored is None and not is_seq2seq(config):
        cache_dir = weights_cache.parent if weights_cache is not None else None
        divisors = calibrate(model.get_decoder(), _smoothed, model_dir, cache_dir)
    sharded = shard_model(model, tp) if tp is not None else None
    if sharded is not None:  # a row-parallel layer keeps its columns' scales
        divisors = sharded.kept_columns(model, divisors)
    model = model.to(device)  # type: ignore[arg-type]  # transformers' .to() stub loses self
    decoder = model.get_decoder()
    lm_head, exact = _quantize(model, device, quantization, entry, stored, divisors)
    lm_head, layout = apply_linear_layout(
        decoder, lm_head, linear_layout, device, compiled=compiled
    )
    if is_seq2seq(config):  # the encoder's float layers choose their layout on their own
        encoder = model.get_encoder()
        _, encoder_layout = apply_linear_layout(
            encoder, torch.nn.Identity(), linear_layout, device, compiled=compiled
        )
        log.info("encoder's linear layers: %s layout", encoder_layout)
    log.info("linear layers: %s layout; LM head: %s", layout, lm_head)
    # LoRA adapters wrap the projections in their final form (quantized or not), and the sums
    # over the ranks wrap the adapters' (so an adapter's partial delta is summed too)
    lora = LoRAModules.wrap(
        model,
        lora_targets,
        max_loras,
        max_lora_rank,
        dtype,
        shard=sharded,
    )
    if sharded is not None and tp is not None:
        reduce_row_parallel(model, sharded, tp)
    return ServingWeights(model, lm_head, vocab_size, layout, lora, exact)


def _smoothed(name: str) -> bool:
    """Whether `w8a8` runs the layer of this attribute name as a smoothed integer GEMM."""
    return name not in WEIGHT_ONLY["w8a8"]


def _quantize(
    model: PreTrainedModel,
    device: torch.device,
    quantization: str,
    entry: Path | None,
    stored: Layers | None,
    divisors: dict[torch.nn.Linear, torch.Tensor],
) -> tuple[torch.nn.Module, ExactWeights]:
    """Quantize the model's layers as `quantization` says, in place, taking the int8 weights
    `stored` holds (the entry's; writing `entry` when there were none), each layer of `divisors`
    with those input scales; returns the LM head to run and the floating-point weights of the
    decoder's int8 layers (exact_weights.py)."""
    head = model.get_output_embeddings()
    if quantization == "none":
        return head, ExactWeights({})
    parts = {"decoder": model.get_decoder()}
    if is_seq2seq(model.config) and quantization == "w8a8-all":  # as CTranslate2's int8 does
        parts["encoder"] = model.get_encoder()
    names = {id(head.weight): "lm_head"}
    floats: dict[str, torch.Tensor] = {}  # the decoder's, by name: what prompt scoring reads
    scales: dict[str, torch.Tensor] = {}
    for part, module in parts.items():
        for name, layer in module.named_modules():
            if isinstance(layer, torch.nn.Linear):
                names[id(layer.weight)] = f"{part}.{name}"
                if part == "decoder":
                    floats[f"{part}.{name}"] = layer.weight.detach()
                if layer in divisors:
                    scales[f"{part}.{name}"] = divisors[layer]
    quantize = Quantizer(names, stored, scales)
    lm_head = quantized_lm_head(head, device, quantization, quantize)
    weight_only = WEIGHT_ONLY.get(quantization, frozenset())
    if is_seq2seq(model.config) and quantization == "w8a8":
        weight_only = WEIGHT_ONLY_UNSMOOTHED
    for part, module in parts.items():
        if quantization == "int8-weights":
            quantize_decoder_weights(module, device, quantize)
        elif quantization in WEIGHT_ONLY:  # `int8` quantizes the LM head alone
            quantize_w8a8(module, device, weight_only, part, quantize, quantize.divisor)
    if quantize.loaded:
        log.info("int8 weights of %d layers read from %s", quantize.loaded, entry)
    if entry is not None and stored is None:  # a first start: keep them, and map them back
        made = {name: (q, s, floats.get(name), d) for name, (q, s, d) in quantize.made.items()}
        stored = save_layers(entry, made)
    if stored is not None:  # the floating-point weights: the entry's, memory-mapped
        floats = {name: exact for name, (_, _, exact, _) in stored.items() if exact is not None}
    layers = {f"decoder.{name}": layer for name, layer in int8_layers(parts["decoder"]).items()}
    return lm_head, ExactWeights({layer: floats[n] for n, layer in layers.items() if n in floats})
