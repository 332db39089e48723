"""The decode step compiled ahead of time (`--torch-compile`) and kept on disk between starts.

A plain `torch.compile` re-traces the whole decoder with dynamo at every start, even when
inductor's own cache has the kernels: about a minute for Gemma 3 on a 2-core CPU. Here the step is
captured with `aot_compile` (one full graph, its guards, inductor's output) and saved under
beamline's cache; a later start with the same model, flags, software and CPU loads it in seconds.

Dynamo specialises a dimension of size one, so there are two graphs: one row, and any number of
rows from two up. The KV pools reach the graph through the step context (`DecodeStep.kv`), not
through the attention function's closure, so every input is an argument and every guard can be
saved. The guards still run on each call; one that fails falls back to the eager decoder, with a
warning, never to a wrong result. A model whose decoder does not trace as one graph is compiled
the plain way (nothing cached).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from tqdm import tqdm

from server.model.compile_cache import cache_key, entry_lock, key_text, model_identity, partial_path
from server.model.paged_step import PagedStep
from server.model.step_context import DecodeStep, StepContext

log = logging.getLogger(__name__)
ExampleInputs = Callable[[int], tuple[torch.Tensor, torch.Tensor, DecodeStep]]
# what is compiled: (decoder, input ids [1, T], position ids [1, T], step) -> hidden [T, hidden]
DecodeForward = Callable[[Any, torch.Tensor, torch.Tensor, DecodeStep], torch.Tensor]
Source = Literal["loaded", "compiled", "jit"]
# Rows of the two graphs' example steps; any row count >= 2 runs the second graph.
GRAPH_ROWS = (1, 2)


def decode_forward(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    ctx: StepContext | DecodeStep | PagedStep,
) -> torch.Tensor:
    """Hidden states [T, hidden] of a step's packed tokens: the function compiled for decode
    steps, which runs every other step eagerly. It calls the decoder's own forward without
    transformers' wrappers: they fill in defaults this call passes explicitly, and the
    output-capturing one reads a process-wide registry of model classes whose order differs
    between processes, which a saved guard would then not find."""
    forward = inspect.unwrap(type(decoder).forward)
    return forward(
        decoder,
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=None,
        use_cache=False,
        beamline_ctx=ctx,
    ).last_hidden_state[0]


def _saveable_guards(entries: Sequence[Any]) -> list[bool]:
    """Keep every guard that can be saved: not on globals (module objects, builtins), not on
    object identities, which differ from one process to the next. Nor on the name of the attention
    function: each runner registers its own (kv_pool.AttentionBinding), all of them the same code,
    and the compiled step takes its pools from the step context, so only the name would differ."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (
            e.is_global
            or e.guard_type in unsaveable
            or unsaveable & set(e.derived_guard_types)
            or e.name.endswith(".config._attn_implementation_internal")
        )
        for e in entries
    ]


def _misfit(graph: Any, decoder: nn.Module, inputs: tuple[Any, ...]) -> str | None:
    """Why the guards of a loaded graph refuse `inputs` (None: they accept them)."""
    if graph.guard_check(decoder, *inputs):
        return None
    f_locals = graph.prepare_f_locals(decoder, *inputs)
    return "; ".join(graph._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)


def compiled_decoder(
    decoder: Any,
    model_dir: Path,
    cache: Path | None,
    settings: dict[str, str],
    forward: DecodeForward = decode_forward,
) -> CompiledDecode:
    """`decoder`'s compiled decode step, kept in `cache` under a key of the model and the
    `settings` it was compiled for (device, number formats, layouts). `forward`: the function
    compiled (an encoder-decoder model's step is not its decoder module's forward)."""
    identity = {"model": model_identity(model_dir), **settings}
    if cache is None:
        return CompiledDecode(decoder, None, forward=forward)
    about = f"model_dir={model_dir.resolve()}\n{key_text(identity)}"
    return CompiledDecode(decoder, cache / cache_key(identity), about, forward)


def dynamic_tensors(ctx: DecodeStep) -> list[tuple[torch.Tensor, int]]:
    """The dimensions of a step's tensors that vary from step to step beyond the row count
    (the context width; an encoder-decoder step's sources, their width and rows per source):
    marked dynamic, so that no example size is specialized. A dimension of size one is not:
    dynamo specializes those, the one-row graph's (CrossStep.build pads the others)."""
    marked = [(ctx.gather, 1), (ctx.positions, 1)]
    if ctx.cross is not None:
        sources = ctx.cross.sources
        marked += [(sources.gather, 0), (sources.gather, 1), (sources.lengths, 0)]
        marked += [(sources.positions, 1), (ctx.cross.slot_rows, 0), (ctx.cross.slot_rows, 1)]
    return [(tensor, dim) for tensor, dim in marked if tensor.shape[dim] > 1]  # 1: one row


class CompiledDecode:
    """`decode_forward` of one decoder, compiled: call `prepare` once, then call it per step."""

    def __init__(
        self,
        decoder: Any,
        directory: Path | None,
        about: str = "",
        forward: DecodeForward = decode_forward,
    ) -> None:
        self.decoder = decoder
        self.forward = forward
        self.directory = directory  # None: compile, keep nothing on disk
        self.about = about  # what the entry was compiled for: identity.txt beside the graphs
        self.graphs: list[Any] = []
        self.jit: Callable[..., torch.Tensor] | None = None
        self.source: Source | None = None
        self.fallbacks = 0  # calls whose inputs the guards refused: run eagerly instead

    def prepare(self, example: ExampleInputs) -> Source:
        """Load both graphs from the cache directory or compile (and save) them. One process at
        a time per entry: a second server (or test worker) starting on the same model waits for
        the first one's compile and loads its graphs, rather than compiling them beside it."""
        if self.directory is None:
            return self._prepare(example)
        with entry_lock(self.directory):
            return self._prepare(example)

    def _prepare(self, example: ExampleInputs) -> Source:
        if self.directory is not None and (graphs := self.read_cached()) is not None:
            why = self.adopt(graphs, example)
            if why is None:
                return "loaded"
            log.warning(
                "compiled decode step in %s does not fit (%s): compiling", self.directory, why
            )
        log.info(
            "compiling the decode step (%d graphs; about 1.5 min on 2 CPU cores; %s)",
            len(GRAPH_ROWS),
            "later starts load it" if self.directory is not None else "kept in memory only",
        )
        try:
            # a bar per graph: the only progress inductor's compile reports to us
            with tqdm(total=len(GRAPH_ROWS), desc="Compiling decode step", unit="graph") as bar:
                self.graphs = []
                for rows in GRAPH_ROWS:
                    self.graphs.append(self._compile(example(rows)))
                    bar.update()
        except Exception as error:  # a graph break, an op dynamo cannot trace
            log.warning("decode step not compiled ahead of time (%s): plain torch.compile", error)
            self.jit = torch.compile(self.forward, dynamic=True)
            self.source = "jit"
            return self.source
        self._use(self.graphs, "compiled")
        if self.directory is not None:
            self._save()
        return "compiled"

    def adopt(self, graphs: list[Any], example: ExampleInputs) -> str | None:
        """Use `graphs` (read_cached's) from now on if their guards accept `example`'s steps;
        else why not (nothing changes)."""
        misfits = [_misfit(g, self.decoder, example(r)) for g, r in zip(graphs, GRAPH_ROWS)]
        if any(misfits):
            return "; ".join(m for m in misfits if m)
        self._use(graphs, "loaded")
        return None

    def _use(self, graphs: list[Any], source: Source) -> None:
        for graph in graphs:  # checked once per call in __call__, not twice
            graph.disable_guard_check()
        self.graphs, self.source = graphs, source

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: DecodeStep
    ) -> torch.Tensor:
        if self.jit is not None:
            # the context width (>= 2) varies every step: never specialize on it
            for tensor, dim in dynamic_tensors(ctx):
                torch._dynamo.mark_dynamic(tensor, dim)
            return self.jit(self.decoder, input_ids, position_ids, ctx)
        if not self.graphs:
            raise RuntimeError("CompiledDecode.prepare was not called")
        graph = self.graphs[0 if input_ids.shape[1] == 1 else 1]
        args = (self.decoder, input_ids, position_ids, ctx)
        if graph.guard_check(*args):
            return graph(*args)
        self.fallbacks += 1
        if self.fallbacks == 1:  # never expected: the cache key covers what the guards check
            why = _misfit(graph, self.decoder, args[1:])
            log.warning("the compiled decode step does not fit this step (%s): runs eagerly", why)
        return self.forward(*args)

    def _compile(self, inputs: tuple[torch.Tensor, torch.Tensor, DecodeStep]) -> Any:
        input_ids, position_ids, ctx = inputs
        marked = dynamic_tensors(ctx)
        for tensor, dim in marked:
            torch._dynamo.mark_dynamic(tensor, dim)
        compiler: Any = torch.compile(
            self.forward,
            fullgraph=True,
            dynamic=True,
            options={"guard_filter_fn": _saveable_guards},
        )
        # a dynamic float would restart the analysis, which aot_compile cannot do
        with torch._dynamo.config.patch(specialize_float=True):
            graph = compiler.aot_compile(((self.decoder, input_ids, position_ids, ctx), {}))
        for tensor, _ in marked:  # the markings would fail the guards
            for mark in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices"):
                if hasattr(tensor, mark):
                    delattr(tensor, mark)
        return graph

    def _paths(self) -> list[Path]:
        assert self.directory is not None
        return [self.directory / f"decode-{rows}.bin" for rows in GRAPH_ROWS]

    @property
    def cached(self) -> bool:
        """Whether the cache entry holds every graph (it may still not fit: `adopt` says)."""
        return self.directory is not None and all(p.is_file() for p in self._paths())

    def read_cached(self) -> list[Any] | None:
        """The entry's graphs, read from disk (None: absent or unreadable). Touches nothing of
        the decoder's: another thread may run it meanwhile."""
        if self.directory is None:
            return None
        paths = self._paths()
        if not all(p.is_file() for p in paths):
            return None
        # the graphs' code names the modules it calls as globals of this form (dynamo's)
        modules: dict[str, object] = {
            "__import_" + name.replace(".", "_dot_"): module
            for name, module in list(sys.modules.items())
            if module is not None
        }
        try:
            graphs = []
            for path in paths:
                with path.open("rb") as file:
                    graphs.append(torch.compiler.load_compiled_function(file, f_globals=modules))
        except Exception as error:  # written by another torch, truncated, ...: compile again
            log.warning("compiled decode step not loaded (%s): compiling", error)
            return None
        return graphs

    def _save(self) -> None:
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # each file written aside and renamed into place: a process loading the entry at the
            # same time (a second server, a test worker) never reads half a graph
            for graph, path in zip(self.graphs, self._paths(), strict=True):
                graph.save_compiled_function(str(partial_path(path)))
                partial_path(path).replace(path)
            (self.directory / "identity.txt").write_text(self.about)
        except Exception as error:  # a read-only cache, a graph this torch cannot serialise
            # (torch 2.11's own errors are not OSErrors): serve anyway, compile again next time
            log.warning("compiled decode step not saved to %s: %s", self.directory, error)
            for path in self._paths():  # no half-written entry for the next start to trip on
                for leftover in (path, partial_path(path)):
                    with contextlib.suppress(OSError):
                        leftover.unlink(missing_ok=True)
