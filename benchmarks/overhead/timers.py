"""Timers installed on a loaded engine after its warm-up: the model's forward (the decoder and LM
head called eagerly, or a CUDA graph's replay; synchronised on CUDA) and the text rendered in the
overlap window."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from server.engine.engine import Engine
from server.model.runner import ModelRunner


class ForwardTimer:
    """Accumulates the seconds spent inside the runner's forward calls (decoder, LM head) and the
    CUDA graphs' replays. Installed after the warm-up: nothing may synchronise inside a capture.
    A call inside a timed one counts once (the CPU's stand-in graphs run the decoder in
    `replay`)."""

    NAMES = ("_run_decoder", "_logits")

    def __init__(self, runner: ModelRunner) -> None:
        self.seconds = 0.0
        self.replays = 0  # while enabled
        self.cuda = runner.device.type == "cuda"
        self.enabled = True  # False: calls go straight through, no device synchronisation
        self._inside = False
        for name in self.NAMES:
            setattr(runner, name, self._timed(getattr(runner, name)))
        runner.decode_step.run = self._timed(runner.decode_step.run)  # eager or compiled
        if runner.graphs is not None:  # captured: each graph's replay is timed whole
            captured = runner.graphs.graphs
            for rows, (graph, output) in list(captured.items()):
                captured[rows] = (TimedReplay(self._timed(graph.replay, replay=True)), output)

    def _timed(self, fn: Callable, replay: bool = False) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            if not self.enabled or self._inside:
                return fn(*args, **kwargs)
            self.replays += replay
            if self.cuda:
                torch.cuda.synchronize()
            self._inside = True
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if self.cuda:
                    torch.cuda.synchronize()
            finally:
                self._inside = False
            self.seconds += time.perf_counter() - start
            return out

        return wrapper


class TimedReplay:
    """A captured graph whose replay is timed."""

    def __init__(self, replay: Callable[[], None]) -> None:
        self.replay = replay


class RenderTimer:
    """Accumulates the seconds the engine spends rendering text inside the overlap window (calls
    that find nothing to render are not counted: a loaded host makes even those take time)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = 0.0
        render = engine._render_outputs

        def timed() -> bool:
            start = time.perf_counter()
            rendered = render()
            if rendered:
                self.seconds += time.perf_counter() - start
            return rendered

        if engine.overlap_outputs:
            engine._render_outputs = timed  # type: ignore[method-assign]


def forward_path(runner: ModelRunner) -> str:
    """The eager decode path: the paged kernel or gather + SDPA."""
    return "paged" if runner.attention_backend == "triton" else "gather"
