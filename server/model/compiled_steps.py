"""A runner's compiled decode steps: the base model's and, on a server with LoRA slots, the
adapter step's.

The adapter step is the same decoder traced with a step's LoRA masks set (`LoRAState.step`), so
each row's adapter slot is an input of its graphs and every projection's delta runs inside them
(lora/modules.py). A step whose rows all run the base model takes the base step's graphs, which
add nothing: a server with LoRA enabled serves base requests as one without LoRA does. Each step
is its own compile-cache entry (compiled_decode.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from server.model.compiled_decode import (
    GRAPH_ROWS,
    CompiledDecode,
    ExampleInputs,
    Source,
    compiled_decoder,
)
from server.model.lora.modules import LoRAModules
from server.model.step_context import DecodeStep

log = logging.getLogger(__name__)


class CompiledSteps:
    """Call it as the decoder's decode step; `warm_up` once first."""

    def __init__(
        self,
        decoder: nn.Module,
        model_dir: Path,
        cache: Path | None,
        lora_modules: LoRAModules | None,
        **settings: str,
    ) -> None:
        self.lora = lora_modules
        self.base = compiled_decoder(decoder, model_dir, cache, settings)
        self.adapters: CompiledDecode | None = None
        if lora_modules is not None:
            self.adapters = compiled_decoder(
                decoder, model_dir, cache, {**settings, "step": "with adapters"}
            )

    def warm_up(self, example: ExampleInputs) -> None:
        """Load or compile each step's graphs, then run each graph once."""
        self.prepare(example)
        self.run_once(example)

    def prepare(self, example: ExampleInputs) -> list[Source]:
        """Load or compile (and save) each step's graphs; what each one did."""
        sources = []
        try:
            for name, step, inputs in self._steps(example):
                started = time.monotonic()
                sources.append(step.prepare(inputs))
                took = time.monotonic() - started
                log.info("%s %s in %.1f s (%s)", name, sources[-1], took, step.directory)
        finally:
            self._clear_example()
        return sources

    def run_once(self, example: ExampleInputs) -> None:
        """Run each graph of each step once (its first call's costs are paid here)."""
        try:
            for _, step, inputs in self._steps(example):
                for rows in GRAPH_ROWS:
                    step(*inputs(rows))
        finally:
            self._clear_example()

    @property
    def sources(self) -> list[Source | None]:
        """How each step's graphs were prepared (None: not yet)."""
        return [step.source for step in self._compiled()]

    @property
    def cached(self) -> bool:
        """Whether the compile cache holds every step's graphs."""
        return all(step.cached for step in self._compiled())

    def read_cached(self) -> list[list[Any]] | None:
        """Every step's graphs read from the compile cache (any thread: the decoder is not
        touched), or None when one is missing or unreadable."""
        graphs = [step.read_cached() for step in self._compiled()]
        return None if any(g is None for g in graphs) else cast(list[list[Any]], graphs)

    def adopt(self, graphs: list[list[Any]], example: ExampleInputs) -> str | None:
        """In the thread that steps, between two steps: use `graphs` (read_cached's) if their
        guards accept `example`'s steps, and run each once; else why not."""
        try:
            steps = self._steps(example)
            for (name, step, inputs), read in zip(steps, graphs, strict=True):
                if (why := step.adopt(read, inputs)) is not None:
                    return f"{name}: {why}"
        finally:
            self._clear_example()
        self.run_once(example)
        return None

    def _compiled(self) -> list[CompiledDecode]:
        return [self.base] + ([self.adapters] if self.adapters is not None else [])

    def _steps(self, example: ExampleInputs) -> list[tuple[str, CompiledDecode, ExampleInputs]]:
        steps = [("decode step", self.base, example)]
        if self.adapters is not None:
            steps.append(("adapter decode step", self.adapters, self._on_adapters(example)))
        return steps

    def _clear_example(self) -> None:
        if self.lora is not None:
            self.lora.state.step = None  # the example's

    def _on_adapters(self, example: ExampleInputs) -> ExampleInputs:
        """`example`'s steps with every row on adapter slot 0, set where the layers read it (the
        tracing, the guards and the warm-up run all read it)."""
        lora = self.lora
        assert lora is not None

        def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
            lora.state.step = lora.example_step(rows)
            return example(rows)

        return inputs

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: DecodeStep
    ) -> torch.Tensor:
        """Hidden states of a decode step: through the adapter step's graphs when a row of it
        runs an adapter."""
        if self.adapters is not None and self.lora is not None and self.lora.in_use:
            return self.adapters(input_ids, position_ids, ctx)
        return self.base(input_ids, position_ids, ctx)

    @property
    def fallbacks(self) -> int:
        """Steps that ran eagerly because a graph's guards refused them (never expected)."""
        return self.base.fallbacks + (self.adapters.fallbacks if self.adapters else 0)
