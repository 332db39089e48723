"""The decode step a runner calls: its decoder run eagerly, or the same step compiled.

Decode-only steps (every row adds one token) may run through torch.compile (on the gather path):
it fuses the element-wise glue between the matmuls and drops most of the per-op dispatch cost,
about half of a one-row step on the CPU. Shapes are dynamic (rows, context width), so one graph
serves every batch size >= 2 and one a single row; both are kept in the compile cache for the
next start (compiled_decode.py). With LoRA slots an adapter step's graphs too, the deltas inside
them (compiled_steps.py). The compiled step is ready before serving, or comes while serving
(background_compile.py): the eager step runs until then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from server.model.background_compile import BackgroundCompile, ForwardClock
from server.model.compiled_decode import ExampleInputs
from server.model.compiled_steps import CompiledSteps
from server.model.step_context import DecodeStep

DecodeFn = Callable[[torch.Tensor, torch.Tensor, DecodeStep], torch.Tensor]
State = Literal["eager", "compiling", "compiled"]


class DecodeStepInUse:
    """Call it as the decode step; `warm_up` before serving, `between_steps` before each step."""

    def __init__(
        self,
        eager: DecodeFn,
        compiled: CompiledSteps | None,
        example: ExampleInputs,
        job: BackgroundCompile | None = None,
    ) -> None:
        self.compiled = compiled
        self.example = example  # steps on a block no sequence owns: compile, check, warm
        self.job = job if compiled is not None else None  # compiling while serving
        self.run: DecodeFn = compiled if compiled is not None and job is None else eager
        self.clock = ForwardClock()  # the runner's forwards, which reading the step waits out

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: DecodeStep
    ) -> torch.Tensor:
        return self.run(input_ids, position_ids, ctx)

    def warm_up(self) -> None:
        """Before serving, in the thread that steps: load or compile the compiled step and run
        each graph once, or start its compile beside serving (read from the cache once the
        runner's `clock` says it has been quiet a while: background_compile.py)."""
        if self.job is not None and self.compiled is not None:
            self.job.start(self.compiled, self.clock.quiet_for)
        elif self.compiled is not None:
            self.compiled.warm_up(self.example)

    def between_steps(self) -> bool:
        """In the thread that steps, between two steps: True at the step from which the step
        compiled while serving runs (it is adopted here)."""
        job, compiled = self.job, self.compiled
        if job is None or compiled is None or not job.done:
            return False
        self.job = None
        with torch.inference_mode():  # as steps run: the guards check it
            if not job.adopt(compiled, self.example):
                return False
        self.run = compiled
        return True

    @property
    def state(self) -> State:
        """What decode steps run now: eager (nothing compiled, or the compile failed), compiling
        (eager meanwhile) or compiled."""
        if self.run is self.compiled:
            return "compiled"
        return "compiling" if self.job is not None else "eager"
