"""Prompt scoring at full precision under an int8 format: the tokens of a request that scores its
prompt (prompt logprobs, `echo` with logprobs: what an evaluation harness reads) run through the
floating-point weights of every int8 layer, the other tokens of the same step through the int8
kernels as before.

The int8 LM head alone is not the error an evaluation sees. On Gemma 3 270M over the bundled text,
against the floating-point model: w8a8's decoder moved a token's logprob by 0.11 nats on average
(a 5-token continuation's sum by up to 0.96); its weights alone (int8 weights, floating-point
activations) by 0.06 (sums up to 0.77); bfloat16 weights by 0.006 (sums up to 0.09). Only the
weights the exact mode runs keep a choice's log-likelihood where the exact mode puts it.

Where the floating-point weights live: with a cache dir, in a file of the weights cache
(weights_cache.py), memory-mapped, whose pages the OS reads when a scoring step first needs them
and may drop again, so they take no memory while nobody scores; without one, in memory (the loaded
model's tensors, kept rather than freed).

Each int8 layer gets two hooks for the length of such a step (none otherwise, so the compiled
decode step never sees them): before it, the layer's input loses the exact tokens; after it, their
rows come back computed from the floating-point weight. The int8 kernels compute a token from its
own row alone, so the others' results are those of a step without the exact tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from server.model.quantization import Int8Linear
from server.step_plan import StepPlan


class ExactWeights:
    """The floating-point weight of each int8 layer of a model, for the tokens that score."""

    def __init__(self, weights: dict[Int8Linear, torch.Tensor]) -> None:
        self.weights = weights

    def __len__(self) -> int:
        return len(self.weights)

    @contextlib.contextmanager
    def rows(self, plan: StepPlan, row_starts: list[int], device: torch.device) -> Iterator[None]:
        """Within: the tokens of the plan's `exact` rows (packed from `row_starts` on) run
        through the floating-point weights."""
        if not plan.exact or not self.weights:
            yield
            return
        chosen = torch.zeros(plan.num_tokens, dtype=torch.bool)
        for r in plan.exact:
            chosen[row_starts[r] : row_starts[r] + plan.num_new[r]] = True
        exact_index = chosen.nonzero().squeeze(1).to(device)
        rest_index = (~chosen).nonzero().squeeze(1).to(device)
        handles = []
        for layer, weight in self.weights.items():
            split = _Split(weight, exact_index, rest_index)
            handles.append(layer.register_forward_pre_hook(split.before))
            handles.append(layer.register_forward_hook(split.after))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


class _Split:
    """One layer's hooks for one step: the int8 kernel sees the rest, the weight the exact."""

    def __init__(self, weight: torch.Tensor, exact: torch.Tensor, rest: torch.Tensor) -> None:
        self.weight, self.exact, self.rest = weight, exact, rest
        self.input: torch.Tensor | None = None

    def before(self, layer: Int8Linear, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        self.input = args[0]
        return (args[0].reshape(-1, layer.in_features).index_select(0, self.rest),)

    def after(
        self, layer: Int8Linear, _args: tuple[Any, ...], rest_out: torch.Tensor
    ) -> torch.Tensor:
        x, self.input = self.input, None
        assert x is not None
        flat = x.reshape(-1, layer.in_features)
        out = rest_out.new_empty(flat.shape[0], layer.out_features)
        out.index_copy_(0, self.rest, rest_out)
        exact_in = flat.index_select(0, self.exact).to(self.weight.dtype)
        bias = None if layer.bias is None else layer.bias.to(self.weight.dtype)
        exact_out = torch.nn.functional.linear(exact_in, self.weight, bias)
        out.index_copy_(0, self.exact, exact_out.to(out.dtype))
        return out.view(*x.shape[:-1], layer.out_features)


def int8_layers(module: torch.nn.Module) -> dict[str, Int8Linear]:
    """Every int8 layer under `module`, by its name there."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Int8Linear)}
