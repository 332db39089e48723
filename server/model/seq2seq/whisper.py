"""Whisper in the paged step: what differs from BART's (decoder.py) is the encoder's input.

Whisper's encoder reads a 30-second window's log-mel spectrogram, not token ids, and always
writes `max_source_positions` states (1,500: two convolutions halve its 3,000 frames). A request's
source is therefore that many placeholder ids, which hold the row's source positions in its block
table and KV budget as any source's ids do, and its features travel beside them
(`SourceEncode.features`); the front end makes the placeholders of different audio different for
the prefix cache (server/audio/). The decoder is BART's with a learned position table read by
index, no embedding scale and no embedding layer norm; its LM head is the token embedding.

Its alignment heads (the generation config's `alignment_heads`; else, as openai-whisper, every
head of the decoder's second half) are the cross-attention heads whose scores a `cross_attention`
request returns (attention.py keeps them): where in the audio each token was heard, for word
timestamps (server/audio/alignment.py).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from server.model.seq2seq.decoder import Seq2SeqParts
from server.step_plan import SourceEncode


class WhisperParts(Seq2SeqParts):
    def __post_init__(self) -> None:
        super().__post_init__()
        config = cast(Any, self.model).config
        heads = getattr(getattr(self.model, "generation_config", None), "alignment_heads", None)
        if not heads:
            layers, per_layer = config.decoder_layers, config.decoder_attention_heads
            heads = [(i, h) for i in range(layers // 2, layers) for h in range(per_layer)]
        self.alignment_heads = sorted((int(i), int(h)) for i, h in heads)
        for index, layer in enumerate(self.layers):
            attn = self.cross_attention(layer)
            attn.beamline_alignment_heads = [h for i, h in self.alignment_heads if i == index]

    def encode(self, encodes: list[SourceEncode], device: torch.device) -> list[torch.Tensor]:
        """The encoder's output [1500, d_model] of each window, the windows in one call."""
        if any(encode.features is None for encode in encodes):
            raise RuntimeError("a Whisper source without its audio features")
        features = torch.stack([cast(torch.Tensor, encode.features) for encode in encodes])
        dtype = cast(torch.Tensor, cast(Any, self.encoder).conv1.weight).dtype
        out = self.encoder(input_features=features.to(device=device, dtype=dtype))
        states = cast(torch.Tensor, out.last_hidden_state)
        return [states[index, : len(encode.source)] for index, encode in enumerate(encodes)]
