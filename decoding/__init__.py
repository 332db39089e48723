"""Pure decoding algorithms over batched logits: no HTTP, no scheduler."""

from decoding.params import DecodingParams, DecodingParamsError
from decoding.sampling import SamplingTensors, sample_next_tokens

__all__ = ["DecodingParams", "DecodingParamsError", "SamplingTensors", "sample_next_tokens"]
