"""T5's family (T5, Flan-T5, mT5) in the paged step: what differs from BART's (decoder.py).

T5 has no position embeddings: its self-attention adds a learned bias per head for each bucket of
the distance between key and query (`relative_attention_bias`, held by the first decoder layer
and shared by all). transformers computes it for contiguous positions of one sequence; here the
attention function computes it for each row's own positions (`relative_bias`, marked on every
decoder self-attention as `beamline_relative_bias`). The distance is the same measured from the
row's start or from the decoder's, so absolute row positions serve. Cross-attention has no bias
(zeros in transformers), and attention is not scaled (transformers passes a scaling of 1).

Each decoder block is called with stand-ins for the two biases transformers would otherwise
compute (and that the attention function does not read), and the encoder's stand-in output.
Tied embeddings scale the decoder's output by d_model ** -0.5 before the LM head
(`scale_decoder_outputs`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from server.model.seq2seq.decoder import Seq2SeqParts
from server.model.step_context import DecodeStep, StepContext

T5_FAMILIES = frozenset({"t5", "mt5"})


def relative_bias(attention: Any, relative: torch.Tensor) -> torch.Tensor:
    """The bias [..., heads] of key-minus-query distances `relative` (a decoder's: one way)."""
    buckets = attention._relative_position_bucket(
        relative,
        bidirectional=False,
        num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance,
    )
    return cast(torch.Tensor, attention.relative_attention_bias(buckets))


def weight_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype of a linear layer's weight, under whichever name its layout keeps it
    (cpu_linear.py, quantization.py): what T5 reads `wo.weight` for."""
    for name in ("weight_int8", "packed", "weight_t"):
        held = getattr(layer, name, None)
        if isinstance(held, torch.Tensor):
            return held.dtype
    raise TypeError(f"no weight found in {type(layer).__name__}")


class T5Parts(Seq2SeqParts):
    def __post_init__(self) -> None:
        super().__post_init__()
        first = self.layers[0].layer[0].SelfAttention
        bias = functools.partial(relative_bias, first)
        for layer in self.layers:
            layer.layer[0].SelfAttention.beamline_relative_bias = bias
        encoder = cast(Any, self.model).get_encoder()
        for layer in [*self.layers, *encoder.block]:  # T5's feed-forward casts its input to
            wo = layer.layer[-1].DenseReluDense.wo  # `wo.weight`'s dtype
            if not isinstance(getattr(wo, "weight", None), torch.Tensor):
                wo.weight = torch.empty(0, dtype=weight_dtype(wo))  # a CPU layout's layer
        self.scale = cast(Any, self.model).model_dim ** -0.5
        self.scales_output = bool(getattr(self.model.config, "scale_decoder_outputs", False))

    def _layers(self) -> list[Any]:
        return list(cast(Any, self.decoder).block)

    def cross_attention(self, layer: Any) -> Any:
        return layer.layer[1].EncDecAttention

    PROJECTIONS = ("k", "v")
    HEAD_DIM = "key_value_proj_dim"

    def forward(
        self,
        input_ids: torch.Tensor,
        relative: torch.Tensor,
        ctx: StepContext | DecodeStep,
    ) -> torch.Tensor:
        decoder = cast(Any, self.decoder)
        hidden = decoder.embed_tokens(input_ids)
        unused = hidden.new_zeros(1)  # the biases transformers would compute: not read
        for layer in self.layers:
            hidden = layer(
                hidden,
                None,
                unused,
                self.stand_in(hidden),
                None,
                unused,
                cache=None,
                beamline_ctx=ctx,
            )[0]
        return cast(torch.Tensor, decoder.final_layer_norm(hidden)[0])

    def logits(
        self, head: nn.Module, hidden: torch.Tensor, ranked: int = 0, exact: Sequence[int] = ()
    ) -> torch.Tensor:
        if self.scales_output:
            hidden = hidden * self.scale
        return super().logits(head, hidden, ranked, exact)
