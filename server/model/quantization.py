"""int8 weight formats for the CPU (docs/guides/tuning.md has their speed and accuracy); `w8a8` is
the default on CPUs with int8 dot-product instructions (devices.resolve_quantization).

`int8` quantizes the LM head only (`RescoredInt8Head`, below). With Gemma's 262k-token vocabulary
the head is most of a CPU step.

`int8-weights` adds *weight-only* int8 for the decoder's linear layers: int8 weights with
per-output-channel scales, bf16 activations, no activation quantization. Quantizing the decoder
layers dynamically (activations too, like the head) was measured and rejected: it nearly doubled
Gemma 3 270M's perplexity on the bundled text (32.0 -> 54), because Gemma's activations have outlier
channels that a per-tensor int8 scale flattens. Weight-only keeps them.

`w8a8` runs the decoder's linear layers as integer GEMMs: int8 weights (per-output-channel scales)
times int8 activations with one scale per token, quantized on the fly (`torch._int_mm`, VNNI on
AVX-512 CPUs). At 16 rows this is about twice as fast as the weight-only kernel, which converts
every weight to floating point and is compute-bound there. A per-*token* scale keeps each row's
result independent of its batch-mates (the int32 sums are exact) and costs far less accuracy than a
per-tensor one. Each integer layer's input is first divided by per-channel scales measured at
quantization (smoothing.py, SmoothQuant's), which moves the outlier channels of a language
model's activations (Gemma's normed hidden state, what `q_proj`, `k_proj` and `v_proj` read) into
the weights; without them those three had to stay weight-only for accuracy. The MLP's
`down_proj` (the gated GELU product) stays weight-only: quantizing its input cost 1-1.5% of
perplexity even smoothed (smoothing.py has the figures). Causal LMs only: an encoder-decoder
model's `w8a8` runs its q/k/v weight-only, unsmoothed, as before (the scales would need a source
and a target to measure on), and `w8a8-all` is its fast format.

`w8a8-all` runs every decoder linear layer as an integer GEMM, those four too, and an
encoder-decoder model's encoder's as well: what CTranslate2's int8 compute type does. It trades
the accuracy above for speed where the weight-only kernel is the slower one (it is about twice
`_int_mm`'s time at 32 rows of a 512-wide layer); its figures on Gemma are in
docs/guides/tuning.md.

Every int8 format runs the LM head as `RescoredInt8Head`: int8 x int8 logits for the whole
vocabulary, then the top `RESCORED_CANDIDATES` of each row computed again exactly from the
floating-point head weights. Greedy, beam search and top-k (k up to that count) therefore rank
their candidates by the floating-point head's logits, as long as the floating-point top tokens are
among the int8 top candidates (benchmarks/accuracy.py measures how far down they ever fall); only
the far tail (what a softmax normalizer or a top-p mass adds up) keeps int8 error. A step whose
rows each read only a few likeliest tokens (greedy, beam search, small top-k: the step plan's
`ranked`) re-scores fewer: three times that many, at least 16. Prompt scoring (prompt logprobs,
`echo` with logprobs: what an evaluation harness reads) asks for `EXACT_LOGITS` instead: the
floating-point head over the whole vocabulary, so that a target token outside the candidates and
the softmax's normalizer carry no int8 error (the decoder's own formats still change the scores,
as they change every hidden state: docs/guides/scoring.md).

`benchmarks/accuracy.py` reports perplexity and greedy agreement of each format against fp32.
CPU only: every kernel here is a CPU kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import cast

import torch

from decoding.top_k import largest
from server.model.cpu_linear import replace_linears
from server.model.devices import QUANTIZATIONS
from server.model.int8_products import (
    OneDNNRowProduct,
    Quantize,
    quantize_per_channel,
    row_product,
)

log = logging.getLogger(__name__)

# Linear layers whose input has outlier channels that a per-token int8 scale would flatten even
# smoothed: under `w8a8` they keep int8 weights with floating-point activations.
WEIGHT_ONLY_UNDER_W8A8 = frozenset({"down_proj"})
# An encoder-decoder model's `w8a8` is not smoothed (smoothing.py): its attention's input
# projections stay weight-only too.
WEIGHT_ONLY_UNSMOOTHED = WEIGHT_ONLY_UNDER_W8A8 | {"q_proj", "k_proj", "v_proj"}
# the layers each integer-GEMM format keeps weight-only
WEIGHT_ONLY = {"w8a8": WEIGHT_ONLY_UNDER_W8A8, "w8a8-all": frozenset[str]()}


class Int8Linear(torch.nn.Module):
    """int8 weights [out, in] with per-output-channel scales; subclasses choose the kernel."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    scale_dtype = torch.float32

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantize: Quantize = quantize_per_channel,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = quantize(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales.to(self.scale_dtype))
        self.bias = (
            None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]


class Int8WeightOnlyLinear(Int8Linear):
    """A linear layer with int8 weights and per-output-channel scales; activations stay floating.

    Runs PyTorch's weight-only int8 kernel (`aten._weight_int8pack_mm`), which takes bfloat16
    activations: the input is rounded to bf16 for the product and the output returned in the
    input's dtype. Unlike dynamic quantization, no activation is quantized, so Gemma's outlier
    channels survive and a row's result never depends on the other rows of the batch.
    """

    scale_dtype = torch.bfloat16  # what the weight-only kernel takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int8DynamicLinear(Int8Linear):
    """int8 weights x int8 activations (one scale per token, computed per call), int32 sums.

    Each row is quantized with its own scale, so a row's result never depends on the other rows of
    the batch; the weight is kept [out, in] and read through a transposed view, the layout in which
    `torch._int_mm` is fastest on the CPU. `divisor` [in]: the input's per-channel scales
    (smoothing.py); the weight is quantized with its columns multiplied by them, and each input
    multiplied by their inverse.
    """

    input_scales: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantize: Quantize = quantize_per_channel,
        divisor: torch.Tensor | None = None,
    ) -> None:
        smoothed = quantize if divisor is None else functools.partial(quantize, divisor=divisor)
        super().__init__(weight, bias, smoothed)
        inverse = None if divisor is None else divisor.float().reciprocal()
        self.register_buffer("input_scales", inverse)

    def dequantized_weight(self) -> torch.Tensor:
        weight = super().dequantized_weight()
        return weight if self.input_scales is None else weight * self.input_scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        if self.input_scales is not None:
            flat = flat * self.input_scales
        row_scales = flat.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
        # |x| / scale <= 127 (up to rounding far below .5): no clamp needed before int8
        q = flat.div(row_scales).round_().to(torch.int8)
        # in place on the product's float copy: the same operations, in the same order, as
        # `int32 * row_scales * scales + bias`, without a new tensor for each
        out = torch._int_mm(q, self.weight_int8.t()).float().mul_(row_scales).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def kernel_supports(in_features: int) -> bool:
    """`_weight_int8pack_mm` on the CPU needs K % 16 == 0: other sizes gave wrong sums (K = 8, 24)
    or crashed (K = 7) in torch 2.13, so such layers keep their floating-point weights."""
    return in_features % 16 == 0


def quantize_decoder_weights(
    decoder: torch.nn.Module, device: torch.device, quantize: Quantize = quantize_per_channel
) -> int:
    """Replace the linear layers under `decoder` by Int8WeightOnlyLinear; returns the count."""
    if device.type != "cpu":
        raise ValueError("int8-weights runs on the CPU only; use --dtype bfloat16 on CUDA")
    count = replace_linears(
        decoder,
        lambda layer: Int8WeightOnlyLinear(layer.weight, layer.bias, quantize),
        lambda _name, layer: kernel_supports(layer.in_features),
    )
    log.info("decoder quantized: %d linear layers with int8 weights (weight-only)", count)
    return count


def quantize_w8a8(
    module: torch.nn.Module,
    device: torch.device,
    weight_only: frozenset[str] = WEIGHT_ONLY_UNDER_W8A8,
    part: str = "decoder",
    quantize: Quantize = quantize_per_channel,
    divisor: Callable[[torch.Tensor], torch.Tensor | None] = lambda _weight: None,
) -> int:
    """Replace the linear layers under `module` (a decoder, or an encoder-decoder model's
    encoder under w8a8-all) by Int8DynamicLinear, except those named in `weight_only`, which
    become Int8WeightOnlyLinear; returns the count of both. `part`: what the log line calls it.
    `divisor`: a layer's input scales (smoothing.py) by its float weight, or None."""
    if device.type != "cpu":
        raise ValueError("w8a8 runs on the CPU only; use --dtype bfloat16 on CUDA")
    kept = replace_linears(
        module,
        lambda layer: Int8WeightOnlyLinear(layer.weight, layer.bias, quantize),
        lambda name, layer: name in weight_only and kernel_supports(layer.in_features),
    )
    dynamic = replace_linears(
        module,
        lambda layer: Int8DynamicLinear(layer.weight, layer.bias, quantize, divisor(layer.weight)),
        lambda name, _layer: name not in weight_only,  # an unsupported down_proj stays float
    )
    smoothed = sum(
        isinstance(m, Int8DynamicLinear) and m.input_scales is not None for m in module.modules()
    )
    log.info(
        "%s quantized: %d linear layers with int8 weights and int8 per-token activations "
        "(%d with input scales), %d weight-only (%s)",
        part,
        dynamic,
        smoothed,
        kept,
        ", ".join(sorted(weight_only)) or "none",
    )
    return dynamic + kept


# How many of each row's int8 logits are computed again exactly. On Gemma 3 270M (262k vocabulary),
# over every position of benchmarks/accuracy_text.txt, the floating-point top token never ranked
# below third among the int8 logits with the fp32 decoder, fourth with w8a8's
# (benchmarks/accuracy.py: worst_int8_rank_of_top_token; 2026-11-26).
RESCORED_CANDIDATES = 64
# A step whose rows each read only their `ranked` likeliest tokens (greedy 1, beam search 2 x
# beams, top-k sampling k: StepPlan.ranked) re-scores RANKED_MARGIN x that many, at least
# MIN_RESCORED: on the same text, the floating-point top 8 tokens of w8a8-all's decoder ranked
# at worst 17th among the int8 logits (top 1: 3rd, top 4: 7th, top 16: 26th, top 32: 45th;
# 2026-11-29). In process, one thread, 24 instead of 64 took a Marian-shaped beam step (32 rows,
# 58k vocabulary) from about 5.3 to 5.0-5.2 ms in the head (of 18 ms; the selection's first pass
# over the logits stays), and 16 greedy Gemma rows' steps 3-4% faster.
RANKED_MARGIN = 3
MIN_RESCORED = 16
# The `ranked` of logits read as logprobs over the whole vocabulary (prompt scoring): an int8
# head computes every logit from its floating-point weight
EXACT_LOGITS = -1


class RescoredInt8Head(torch.nn.Module):
    """An LM head [vocab, hidden] run as an int8 GEMM, whose top `candidates` logits per row are
    then replaced by the exact floating-point ones.

    The int8 GEMM quantizes each row with its own scale, so a row's logits never depend on its
    batch-mates (int8_products.py: oneDNN's int8 linear, or fbgemm's where oneDNN's is missing;
    either is about twice as fast here as `torch._int_mm` for this shape). The floating-point
    weight is the head's own (for a tied head, the embedding table, so keeping it costs nothing).
    Takes and returns float32.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        candidates: int = RESCORED_CANDIDATES,
        quantize: Quantize = quantize_per_channel,
    ) -> None:
        super().__init__()
        self.weight = weight.detach()  # shared with the model, not a parameter of this module
        self.candidates = min(candidates, weight.shape[0])
        self.int8 = row_product(weight, quantize)

    def approximate(self, x: torch.Tensor) -> torch.Tensor:
        """int8 logits [rows, vocab] of float32 rows [rows, hidden]."""
        return cast(torch.Tensor, self.int8(x))

    def rescored(self, ranked: int = 0) -> int:
        """Candidates re-scored per row when each row reads its `ranked` likeliest tokens (0:
        every token's rank, as top-p sampling does)."""
        if ranked <= 0:
            return self.candidates
        return min(self.candidates, max(MIN_RESCORED, RANKED_MARGIN * ranked))

    def forward(self, x: torch.Tensor, ranked: int = 0) -> torch.Tensor:
        if ranked == EXACT_LOGITS:  # the floating-point head, whole
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).float()
        flat = x.reshape(-1, x.shape[-1]).float()
        logits = self.approximate(flat)
        top = largest(logits, self.rescored(ranked), sorted=False)[1]
        # [rows, candidates, hidden]; index_select: 3x faster on the CPU than indexing
        rows = self.weight.index_select(0, top.view(-1)).view(*top.shape, -1).to(flat.dtype)
        # a multiply and a sum, not a bmm: its reduction order, and so a row's logits, would
        # change with the number of rows
        logits.scatter_(1, top, (rows * flat.unsqueeze(1)).sum(dim=2))
        return logits.view(*x.shape[:-1], logits.shape[-1])

    def extra_repr(self) -> str:
        vocab, hidden = self.weight.shape
        kernel = "oneDNN" if isinstance(self.int8, OneDNNRowProduct) else "fbgemm"
        return (
            f"int8 {vocab} x {hidden} ({kernel}), top {self.candidates} rescored in "
            f"{self.weight.dtype}"
        )

    def __repr__(self) -> str:  # one line in the start-up log, not the int8 child's repr too
        return f"{type(self).__name__}({self.extra_repr()})"


def head_logits(
    head: torch.nn.Module, x: torch.Tensor, ranked: int = 0, exact: Sequence[int] = ()
) -> torch.Tensor:
    """`head(x)` of rows x [rows, hidden]; a RescoredInt8Head re-scores as many candidates as
    `ranked` asks for (every logit with `EXACT_LOGITS`), and computes every logit of the rows
    `exact` from its floating-point weight (rows whose logprobs are returned)."""
    if not isinstance(head, RescoredInt8Head):
        return head(x)
    logits = cast(torch.Tensor, head(x, ranked))
    if exact:
        index = torch.tensor(exact, device=x.device)
        logits.index_copy_(0, index, head(x.index_select(0, index), EXACT_LOGITS))
    return logits


def quantized_lm_head(
    head: torch.nn.Module,
    device: torch.device,
    method: str,
    quantize: Quantize = quantize_per_channel,
) -> torch.nn.Module:
    """The LM head to run: `head` itself, or a RescoredInt8Head over its weight (which takes
    float32 inputs)."""
    if method == "none":
        return head
    if method not in QUANTIZATIONS or method == "auto":  # auto is resolved before loading
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if device.type != "cpu":
        raise ValueError("int8 quantization runs on the CPU only; use --dtype bfloat16 on CUDA")
    rescored = RescoredInt8Head(cast(torch.Tensor, head.weight), quantize=quantize)
    log.info("LM head quantized: %s", rescored.extra_repr())
    return rescored
