"""An encoder-decoder model (BART, mBART, Marian, Pegasus, M2M100 / NLLB) split into what a
paged, continuously batched step needs: the encoder run once per source, each decoder layer's
cross-attention keys and values of it written into the row's first positions of the KV pool, and
the decoder run over packed tokens of many rows with its attention on the pool (attention.py).

transformers' decoder `forward` cannot take per-token positions of packed rows, so the decoder's
own parts are called here in its order: token embeddings (and the families' scale), position
embeddings of the decoder-relative position, the embedding layer norm where the family has one,
every decoder layer as it is, the final layer norm where there is one. Each layer's
cross-attention is handed a one-position stand-in for the encoder output (an empty one cannot be
reshaped into heads) and is marked `beamline_cross`, so the attention function reads the source's
keys and values from the pool instead. Its key and value projections are kept aside for
`write_sources` and replaced in the layer by `UnusedProjection`: what the layer would project
from the stand-in is never read, and two int8 GEMM calls per layer and step cost about 2% of a
Marian-sized step. The LM head adds the families' `final_logits_bias`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from server.model.kv_cache import PagedKVCache
from server.model.quantization import head_logits
from server.model.step_context import DecodeStep, StepContext
from server.step_plan import SourceEncode

# how each family embeds a decoder position p (0 for the decoder's first token)
LEARNED = "learned"  # BART, mBART: a table offset by 2, called with position ids
SINUSOIDAL = "sinusoidal"  # Marian, Pegasus: a fixed table, called with position ids
PADDING_OFFSET = "padding_offset"  # M2M100 / NLLB: fairseq's positions, padding_idx + 1 + p
INDEXED = "indexed"  # Whisper: a learned table, row p
POSITIONS = {
    "bart": LEARNED,
    "mbart": LEARNED,
    "marian": SINUSOIDAL,
    "pegasus": SINUSOIDAL,
    "m2m_100": PADDING_OFFSET,
    "whisper": INDEXED,
}
# families whose decoder scales the token embeddings in its forward (the others' embedding
# module scales them itself)
SCALED_IN_FORWARD = frozenset({"marian", "pegasus"})


@dataclass
class Seq2SeqParts:
    """The parts of a loaded `AutoModelForSeq2SeqLM` a step calls."""

    model: nn.Module
    model_type: str

    def __post_init__(self) -> None:
        model = cast(Any, self.model)
        self.encoder = cast(nn.Module, model.get_encoder())
        self.decoder = cast(nn.Module, model.get_decoder())
        self.layers = self._layers()
        # each layer's cross-attention key and value projections, used on the source only
        self.source_projections = [
            self._set_aside(self.cross_attention(layer)) for layer in self.layers
        ]
        for module in self.encoder.modules():  # the encoder attends as transformers' SDPA does
            if hasattr(module, "k_proj") or hasattr(module, "k"):
                setattr(module, "beamline_unpaged", True)  # noqa: B010  (a marker attribute)
        bias = getattr(self.model, "final_logits_bias", None)
        # most checkpoints' bias is zeros: adding it would cost a pass over every step's logits
        self.bias = bias if bias is not None and bool(bias.any()) else None
        self._stand_in: torch.Tensor | None = None
        # (layer, head) of the cross-attention heads a `cross_attention` request reads, in order
        self.alignment_heads: list[tuple[int, int]] = []

    def _layers(self) -> list[Any]:
        return list(cast(Any, self.decoder).layers)

    def cross_attention(self, layer: Any) -> Any:
        """A decoder layer's cross-attention module."""
        return layer.encoder_attn

    # a cross-attention module's key and value projections, and its head size, by name
    PROJECTIONS = ("k_proj", "v_proj")
    HEAD_DIM = "head_dim"

    def _set_aside(self, attn: Any) -> tuple[nn.Module, nn.Module]:
        """Mark a cross-attention to read the pool (attention.py) and swap its key and value
        projections for `UnusedProjection`s; returns the projections."""
        attn.beamline_cross = True
        projections = []
        for name in self.PROJECTIONS:
            layer = getattr(attn, name)
            projections.append(layer)
            setattr(attn, name, UnusedProjection(layer.out_features))
        return projections[0], projections[1]

    def project_source(self, index: int, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s cross-attention keys and values [S, heads, head_dim] of encoder
        states."""
        key, value = self.source_projections[index]
        head_dim = getattr(self.cross_attention(self.layers[index]), self.HEAD_DIM)
        shape = (part.shape[0], -1, head_dim)
        return key(part).view(shape), value(part).view(shape)

    def encode(self, encodes: list[SourceEncode], device: torch.device) -> list[torch.Tensor]:
        """The encoder's output [S, d_model] of each source, in one call: the sources padded on
        the right to the longest (which changes no source's positions), the padded keys masked.
        The mask is handed over whole ([B, 1, 1, S], True where a key is attended):
        transformers builds none for an attention function it does not know, as the encoder's
        is here (attention.py serves it with transformers' SDPA)."""
        sources = [encode.source for encode in encodes]
        longest = max(len(source) for source in sources)
        pad = getattr(self.model.config, "pad_token_id", None) or 0
        ids = torch.full((len(sources), longest), pad, dtype=torch.long)
        attended = torch.zeros((len(sources), 1, 1, longest), dtype=torch.bool)
        for index, source in enumerate(sources):
            ids[index, : len(source)] = torch.tensor(source, dtype=torch.long)
            attended[index, ..., : len(source)] = True
        padded = any(len(source) < longest for source in sources)
        out = self.encoder(
            input_ids=ids.to(device),
            attention_mask=attended.to(device) if padded else None,
            return_dict=True,
        )
        states = cast(torch.Tensor, out.last_hidden_state)
        return [states[index, : len(source)] for index, source in enumerate(sources)]

    def write_sources(
        self, kv: PagedKVCache, parts: list[torch.Tensor], slots: torch.Tensor
    ) -> None:
        """Every decoder layer's cross-attention keys and values of the encoder states `parts`
        (a source's positions each, in the order of `slots`) into those slots of the pool: one
        projection per layer for the whole step."""
        states = torch.cat(parts) if len(parts) > 1 else parts[0]
        for index in range(len(self.layers)):
            key, value = self.project_source(index, states)
            keys, values = kv.keys[index], kv.values[index]
            keys.index_copy_(0, slots, key.to(keys.dtype))
            values.index_copy_(0, slots, value.to(values.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        relative: torch.Tensor,
        ctx: StepContext | DecodeStep,
    ) -> torch.Tensor:
        """Hidden states [T, d_model] of a step's packed decoder tokens ([1, T] ids at their
        decoder-relative positions `relative` [1, T], counted from the decoder's first token)."""
        decoder = cast(Any, self.decoder)
        hidden = decoder.embed_tokens(input_ids)
        if self.model_type in SCALED_IN_FORWARD:
            hidden = hidden * decoder.embed_scale
        hidden = hidden + self._positions(relative[0]).view_as(hidden).to(hidden.dtype)
        if getattr(decoder, "layernorm_embedding", None) is not None:
            hidden = decoder.layernorm_embedding(hidden)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=None,
                encoder_hidden_states=self.stand_in(hidden),
                encoder_attention_mask=None,
                use_cache=False,
                beamline_ctx=ctx,
            )
        if getattr(decoder, "layer_norm", None) is not None:
            hidden = decoder.layer_norm(hidden)
        return cast(torch.Tensor, hidden[0])

    def stand_in(self, hidden: torch.Tensor) -> torch.Tensor:
        """The one-position encoder output each cross-attention is handed (module docstring):
        kept between eager steps; a compiled step makes its own (a kept one would be state its
        graph guards on)."""
        if torch.compiler.is_compiling():
            return hidden.new_zeros((1, 1, hidden.shape[-1]))
        if self._stand_in is None or self._stand_in.device != hidden.device:
            self._stand_in = hidden.new_zeros((1, 1, hidden.shape[-1]))
        return self._stand_in.to(hidden.dtype)

    def _positions(self, relative: torch.Tensor) -> torch.Tensor:
        table = cast(Any, self.decoder).embed_positions
        kind = POSITIONS[self.model_type]
        if kind == LEARNED:
            return cast(torch.Tensor, table(relative[None], 0, position_ids=relative))
        if kind == SINUSOIDAL:
            return cast(torch.Tensor, table((1, relative.numel()), 0, position_ids=relative))
        if kind == INDEXED:
            return cast(torch.Tensor, table.weight.index_select(0, relative))
        return cast(torch.Tensor, table.weights.index_select(0, relative + table.padding_idx + 1))

    def logits(
        self, head: nn.Module, hidden: torch.Tensor, ranked: int = 0, exact: Sequence[int] = ()
    ) -> torch.Tensor:
        """The LM head's float32 logits, plus the families' `final_logits_bias` (a zero vector
        in most checkpoints); `ranked` and `exact` as quantization.head_logits takes them."""
        logits = head_logits(head, hidden, ranked, exact).float()
        if self.bias is None:
            return logits
        return logits + self.bias.to(logits.dtype).view(-1)[: logits.shape[-1]]


class UnusedProjection(nn.Module):
    """Stands in for a decoder cross-attention's key or value projection in the paged step
    (module docstring): zeros of the projection's output shape, one kept tensor per shape."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self._zeros: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if torch.compiler.is_compiling():  # inside a graph: never read, nothing to keep
            return x.new_zeros(shape)
        zeros = self._zeros
        if (
            zeros is None
            or zeros.shape != shape
            or zeros.dtype != x.dtype
            or zeros.device != x.device
        ):
            zeros = self._zeros = x.new_zeros(shape)
        return zeros


def packed_decode(
    parts: Seq2SeqParts, input_ids: torch.Tensor, relative: torch.Tensor, ctx: DecodeStep
) -> torch.Tensor:
    """The decode step the runner compiles (compiled_decode.py): `parts.forward`."""
    return parts.forward(input_ids, relative, ctx)
