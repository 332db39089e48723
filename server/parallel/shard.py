"""Splitting a loaded model across the ranks of a tensor-parallel group (Megatron-LM's layout).

Which projection splits how comes from the model's own tensor-parallel plan in transformers
(`base_model_tp_plan`: q/k/v and gate/up "colwise", o/down "rowwise") or, for a model without one,
the same plan by layer name. A column-parallel layer keeps its rank's output rows (its heads, or
its slice of the MLP), so attention runs unchanged on the rank's heads; a row-parallel layer keeps
the matching input columns and its output, a partial sum, is summed over the ranks (`RowReduced`,
put around the layer after quantization and LoRA have wrapped it, so the adapter's delta is
summed too). With fewer KV heads than ranks, each rank keeps the one KV head its query heads
read (GQA), so KV heads are replicated. The embedding and the LM head are split by vocabulary.
Every model is checked before loading (`check_tp_size`): the heads and MLP must divide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from server.parallel.group import TPGroup

COLWISE, ROWWISE = "colwise", "rowwise"
# The plan of a model whose config has none (names as in Llama, Gemma, Qwen, Mistral).
FALLBACK_PLAN = {
    "layers.*.self_attn.q_proj": COLWISE,
    "layers.*.self_attn.k_proj": COLWISE,
    "layers.*.self_attn.v_proj": COLWISE,
    "layers.*.self_attn.o_proj": ROWWISE,
    "layers.*.mlp.gate_proj": COLWISE,
    "layers.*.mlp.up_proj": COLWISE,
    "layers.*.mlp.down_proj": ROWWISE,
}
UNSPLIT_STYLES = {"replicated_with_grad_allreduce"}  # q_norm/k_norm: per head, kept whole
# transformers 5.17 adds `embed_tokens: embedding_rowwise` to a tied model's plan: the vocabulary
# split every model gets here (_shard_vocabulary)
VOCABULARY_STYLES = {"embedding_rowwise"}
KV_PROJECTIONS = ("k_proj", "v_proj")


class TPConfigError(ValueError):
    """A tensor-parallel size this model or machine cannot run; said before loading."""


def heads_of(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers text config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return heads, kv_heads, head_dim


def check_tp_size(
    config: Any, size: int, device: torch.device, ranks_here: int | None = None
) -> None:
    """TPConfigError unless `size` ranks (`ranks_here` of them on this node) can split this
    model on this machine."""
    if size == 1:
        return
    heads, kv_heads, _ = heads_of(config)
    problems = []
    if heads % size:
        problems.append(f"its {heads} attention heads do not divide by {size}")
    if kv_heads % size and size % kv_heads:
        problems.append(
            f"its {kv_heads} KV heads neither divide by {size} nor divide {size} (each rank needs "
            "whole KV heads, or one replicated KV head)"
        )
    intermediate = getattr(config, "intermediate_size", None)
    if isinstance(intermediate, int) and intermediate % size:
        problems.append(f"its MLP width {intermediate} does not divide by {size}")
    plan = getattr(config, "base_model_tp_plan", None) or FALLBACK_PLAN
    known = (COLWISE, ROWWISE, *UNSPLIT_STYLES, *VOCABULARY_STYLES)
    unknown = {s for s in plan.values() if s not in known}
    if unknown:
        problems.append(f"its tensor-parallel plan uses {', '.join(sorted(unknown))}")
    if problems:
        raise TPConfigError(
            f"tensor_parallel_size {size} cannot split {config.model_type}: " + "; ".join(problems)
        )
    here = ranks_here or size
    if device.type == "cuda" and torch.cuda.device_count() < here:
        raise TPConfigError(
            f"tensor_parallel_size {size} needs {here} GPUs on this node; it has "
            f"{torch.cuda.device_count()}"
        )


@dataclass
class ShardedModel:
    """What splitting a model left: the kept rows (column-parallel) or columns (row-parallel) of
    each split projection, by its path in the model (LoRA adapters are split the same way)."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    columns: dict[str, torch.Tensor] = field(default_factory=dict)

    def local_shape(self, path: str, in_features: int, out_features: int) -> tuple[int, int]:
        """(in, out) features this rank keeps of the projection at `path`."""
        if path in self.rows:
            return in_features, len(self.rows[path])
        if path in self.columns:
            return len(self.columns[path]), out_features
        return in_features, out_features

    def kept_columns(
        self, model: nn.Module, per_input: dict[nn.Linear, torch.Tensor]
    ) -> dict[nn.Linear, torch.Tensor]:
        """`per_input` (a vector over each layer's input features, measured before splitting)
        with each row-parallel layer's vector cut to the columns this rank keeps."""
        paths = {module: path for path, module in model.named_modules()}
        cut = {layer: self.columns.get(paths.get(layer, "")) for layer in per_input}
        return {
            layer: vector if cut[layer] is None else vector[cut[layer]]
            for layer, vector in per_input.items()
        }

    def shard_adapter(
        self, path: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [out, r] for `path`, cut like the layer."""
        if path in self.rows:
            return a, b[self.rows[path]]
        if path in self.columns:
            return a[:, self.columns[path]], b
        return a, b


def _pattern(prefix: str, key: str) -> re.Pattern[str]:
    body = re.escape(key).replace(r"\*", r"\d+")
    return re.compile(rf"{re.escape(prefix)}{body}$")


def _plan(model: nn.Module) -> list[tuple[re.Pattern[str], str]]:
    """The plan's patterns, as full paths in `model`."""
    decoder = model.get_decoder()  # type: ignore[operator]
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    config = getattr(model.config, "text_config", model.config)
    plan = getattr(config, "base_model_tp_plan", None) or FALLBACK_PLAN
    return [(_pattern(f"{prefix}." if prefix else "", key), style) for key, style in plan.items()]


def _kept_rows(path: str, out_features: int, group: TPGroup, config: Any) -> torch.Tensor:
    """The output rows a rank keeps of a column-parallel layer: an even slice, except a KV
    projection with fewer heads than ranks, where each rank keeps its query heads' KV head."""
    heads, kv_heads, head_dim = heads_of(config)
    if path.rsplit(".", 1)[-1] in KV_PROJECTIONS and kv_heads < group.size:
        head = group.rank * kv_heads // group.size
        return torch.arange(head * head_dim, (head + 1) * head_dim)
    width = out_features // group.size
    return torch.arange(group.rank * width, (group.rank + 1) * width)


def _cut(layer: nn.Linear, rows: torch.Tensor | None, columns: torch.Tensor | None) -> None:
    weight = layer.weight.detach()
    if rows is not None:
        weight = weight[rows]
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.detach()[rows].clone(), requires_grad=False)
    if columns is not None:
        weight = weight[:, columns]
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layer.out_features, layer.in_features = weight.shape


def shard_model(model: nn.Module, group: TPGroup) -> ShardedModel:
    """Keep this rank's share of every split projection, of the embedding and of the LM head."""
    config = getattr(model.config, "text_config", model.config)
    plan = _plan(model)
    sharded = ShardedModel()
    for path, module in list(model.named_modules()):
        style = next((s for pattern, s in plan if pattern.match(path)), None)
        if style is None or style in UNSPLIT_STYLES or not isinstance(module, nn.Linear):
            continue
        if style == COLWISE:
            sharded.rows[path] = _kept_rows(path, module.out_features, group, config)
            _cut(module, sharded.rows[path], None)
        else:
            width = module.in_features // group.size
            sharded.columns[path] = torch.arange(group.rank * width, (group.rank + 1) * width)
            _cut(module, None, sharded.columns[path])
            if module.bias is not None and not group.is_driver:  # added once, by the driver
                module.bias.data.zero_()
    _shard_vocabulary(model, group)
    return sharded


def _shard_vocabulary(model: nn.Module, group: TPGroup) -> None:
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight is embedding.weight
    start, stop = group.vocab_range(embedding.weight.shape[0])
    embedding.weight = nn.Parameter(
        embedding.weight.detach()[start:stop].clone(), requires_grad=False
    )
    embedding.num_embeddings = stop - start
    model.set_input_embeddings(VocabParallelEmbedding(embedding, start, stop, group))  # type: ignore[operator]
    if head is None:
        return
    if tied:
        head.weight = embedding.weight
    else:
        start, stop = group.vocab_range(head.weight.shape[0])
        head.weight = nn.Parameter(head.weight.detach()[start:stop].clone(), requires_grad=False)
    head.out_features = head.weight.shape[0]


class VocabParallelEmbedding(nn.Module):
    """An embedding that holds rows [start, stop) of the vocabulary: each rank embeds the tokens
    it holds (the layer's own forward, so a scaled embedding stays scaled), zeros the rest, and
    the sum over the ranks is every token's embedding."""

    def __init__(self, inner: nn.Module, start: int, stop: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.stop = start, stop
        self.group = group

    @property
    def weight(self) -> torch.Tensor:  # what transformers reads of an input embedding
        return self.inner.weight  # type: ignore[return-value]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = self.inner(local).masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce_(out)


class RowReduced(nn.Module):
    """A row-parallel layer (whatever wraps it: quantization, LoRA) whose partial output is
    summed over the ranks."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(self.inner(x))


def reduce_row_parallel(model: nn.Module, sharded: ShardedModel, group: TPGroup) -> None:
    """Wrap every row-parallel layer in `RowReduced` (last, once the layers are final)."""
    for path in sharded.columns:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attr, RowReduced(getattr(parent, attr), group))
