"""The model runner of an encoder-decoder model: a row is its source, then the decoder's tokens.

The engine schedules an encoder-decoder request like any other: its prompt is the source's ids
followed by the decoder's start, so the source's positions are part of the row's block table and
of its KV budget, beams and `n` samples share them as they share any prompt block, prefix caching
finds an identical source's blocks, and preemption frees them with the rest. What differs is here:
the first step whose row covers source positions runs the encoder over that row's whole source
(batched with the other sources the step reaches) and each step writes every decoder layer's
cross-attention keys and values into the source positions it covers (the plan's `encodes`); the
decoder then runs over the step's decoder tokens only, each row's source length telling attention
which positions are the source (attention.py) and the decoder which position embedding a token
takes (decoder.py).

Encoder-decoder models run on the gather path, in the model's dtype, the encoder's and the
decoder's linear layers and the LM head in the CPU's layout, the encoder choosing its own under
`auto` (cpu_linear.py: on the CPU, oneDNN's prepacked weights where they are timed faster, 3x MKL's
at a step of 64 beam rows of a Marian-sized model on an AMD EPYC host). The CPU's int8 formats
(quantization.py) apply to the decoder and the LM head when asked for (w8a8-all to the encoder as
well); `auto` leaves these models in float32, their exact mode. With `torch_compile` set, a step in
which every row adds one token past its decoder's first (the steady state) runs the decoder
compiled (compiled_decode.py, kept in the compile cache like a decoder-only model's); other steps
run eagerly. Its cross-attention is then padded so that no source dimension is of size one
(step_context.CrossStep), and the graphs' example steps give each dynamic size its own value. No
CUDA graphs, LoRA or tensor parallelism yet (server/runner_setup.py's `check_seq2seq_options`
refuses them when asked for; the devices' defaults are off for them). Whisper (whisper.py: its
encoder reads a window's features) runs in float32, eagerly: its int8 formats and compiled step
are not tested yet, and start-up refuses them.
n-gram speculation works as for any model: its drafts are decoder tokens verified in a packed
step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from server.model.architecture import source_and_target_positions
from server.model.compiled_decode import GRAPH_ROWS, CompiledDecode, compiled_decoder
from server.model.devices import check_runner_options
from server.model.packing import slots
from server.model.paged_step import PagedStep
from server.model.runner import ModelRunner
from server.model.seq2seq.decoder import packed_decode
from server.model.seq2seq.families import parts_of
from server.model.step_context import CrossStep, DecodeStep, StepContext
from server.step_plan import StepOutput, StepPlan

log = logging.getLogger(__name__)


class Seq2SeqRunner(ModelRunner):
    encoder_decoder = True

    def __init__(self, model_dir: Path, **options: Any) -> None:
        compile_decode = bool(options.pop("compile_decode", False))
        cache = options.pop("compile_cache", None)
        # the settings it runs with (runner_setup refuses others when asked for); the base
        # runner's compiled step is a decoder-only model's: this one builds its own
        options.update(
            compile_decode=False,
            cuda_graphs=False,
            attention_backend="gather",
            max_loras=0,
        )
        if compile_decode:
            check_runner_options(
                compile_decode, options.get("quantization", "none"), options["device"]
            )
        super().__init__(model_dir, **options)
        self.parts = parts_of(self.model, str(self.config.model_type))
        # a row holds its source, then the decoder's positions (the front end checks each)
        self.max_position_embeddings = sum(source_and_target_positions(self.config))
        # encoder outputs of sources whose positions are written over several steps, by row id
        self._encoded: dict[int, torch.Tensor] = {}
        self.compiled: CompiledDecode | None = None
        if compile_decode:
            self.compiled = compiled_decoder(
                self.parts,
                model_dir,
                cache,
                {
                    "step": "encoder-decoder",
                    "device": self.device.type,
                    "dtype": str(self.dtype),
                    "quantization": self.quantization,
                    "linear_layout": self.linear_layout,
                    "block_size": str(self.block_size),
                },
                forward=packed_decode,
            )
        self.pad_cross = compile_decode  # the compiled graphs take no source dimension of one
        # the last step's aligned rows' cross-attention scores (attention.py keeps them)
        self._cross_scores: dict[int, dict[int, torch.Tensor]] | None = None

    def _run_decoder(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        ctx: StepContext | DecodeStep | PagedStep,
    ) -> torch.Tensor:
        relative = decoder_positions(position_ids, ctx)
        ctx = cast(StepContext, ctx)  # decoder_positions checked it
        self._cross_scores = ctx.cross_scores
        step = ctx.decode
        if self.compiled is not None and not ctx.prefill and step is not None and fits(step):
            step.kv = self.kv_cache  # every row adds one token: the step is its DecodeStep
            return self.compiled(input_ids, relative, step)
        return self.parts.forward(input_ids, relative, ctx)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Load or compile the decode step, then run each of its graphs once."""
        super().warm_up()
        if self.compiled is None:
            return
        started = time.monotonic()
        source = self.compiled.prepare(self._example_step)
        took = time.monotonic() - started
        log.info("decode step %s in %.1f s (%s)", source, took, self.compiled.directory)
        for rows in GRAPH_ROWS:
            self.compiled(*self._example_step(rows))

    def _example_step(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
        """A decode step on the first blocks (before serving: no row owns them) to compile
        and warm the graphs: one row, or five on two sources (three rows on one), so that no
        two of its dynamic sizes are equal (dynamo would take them for one)."""
        sources = [7] if rows == 1 else [7, 7, 7, 5, 5]
        decoded = 4  # each row's decoder tokens, the new one included
        table = list(range(-(-(max(sources) + decoded) // self.block_size)))
        tables = [table] * len(sources)
        lengths = [source + decoded for source in sources]
        step = DecodeStep.build(tables, lengths, self.block_size, self.device, first=sources)
        step.cross = CrossStep.build(tables, sources, self.block_size, self.device, padded=True)
        step.kv = self.kv_cache
        input_ids = torch.zeros((1, len(sources)), dtype=torch.long, device=self.device)
        relative = torch.full_like(input_ids, decoded - 1)
        return input_ids, relative, step

    def _logits(self, x: torch.Tensor, ranked: int = 0, exact: Sequence[int] = ()) -> torch.Tensor:
        return self.parts.logits(self.lm_head, x.to(self.head_dtype), ranked, exact)

    def _execute(self, plan: StepPlan, tables: list[list[int]]) -> StepOutput:
        """Write the plan's sources' keys and values, then run its decoder tokens."""
        sources = plan.source_lens or [0] * len(plan)
        for row_id in plan.released:
            self._encoded.pop(row_id, None)
        if not plan.encodes:  # the steady state: every row is past its source
            part = replace(plan, source_lens=sources)
            return self._with_scores(self._execute_packed(part, tables), part)
        self._write_sources(plan, tables)
        part, kept = decoder_part(plan, sources)
        if not kept:  # every row's tokens were source positions (a chunked source)
            return StepOutput(torch.empty((0, self.vocab_size), device=self.device))
        return self._with_scores(self._execute_packed(part, [tables[r] for r in kept]), part, kept)

    def _with_scores(
        self, output: StepOutput, part: StepPlan, kept: list[int] | None = None
    ) -> StepOutput:
        """The step's output with its aligned rows' cross-attention scores, by the plan's row
        index (`kept`: the plan's row of each of `part`'s; None: the same rows): [alignment
        heads, the row's decoder tokens, its source positions]."""
        scores, self._cross_scores = self._cross_scores, None
        if not part.aligns or scores is None:
            return output
        starts = part.token_starts()
        for row in part.aligns:
            layers = scores[starts[row]]
            index = row if kept is None else kept[row]
            output.cross_attention[index] = torch.cat([layers[i] for i in sorted(layers)])
        return output

    def _write_sources(self, plan: StepPlan, tables: list[list[int]]) -> None:
        """Run the encoder once over the sources this step reaches first (batched), and write
        the cross-attention keys and values of the positions the step covers. A source longer
        than the step's budget keeps its encoder output until its last chunk is written, so it
        is encoded once, not once per chunk."""
        fresh = [e for e in plan.encodes if plan.row_ids[e.row] not in self._encoded]
        if fresh:
            outputs = self.parts.encode(fresh, self.device)
            for encode, output in zip(fresh, outputs):
                self._encoded[plan.row_ids[encode.row]] = output
        parts: list[torch.Tensor] = []
        where: list[torch.Tensor] = []
        for encode in plan.encodes:
            row_id, start = plan.row_ids[encode.row], plan.starts[encode.row]
            stop = min(len(encode.source), start + plan.num_new[encode.row])
            parts.append(self._encoded[row_id][start:stop])
            where.append(slots(tables[encode.row], start, stop, self.block_size))
            if stop == len(encode.source):
                del self._encoded[row_id]
        self.parts.write_sources(self.kv_cache, parts, torch.cat(where).to(self.device))


def decoder_positions(
    position_ids: torch.Tensor, ctx: StepContext | DecodeStep | PagedStep
) -> torch.Tensor:
    """Each token's position counted from its row's decoder's first token (the row's source
    positions come first in the pool); a step must run packed on the gather path, where the
    context knows each token's source (`_execute`)."""
    if not isinstance(ctx, StepContext) or ctx.source_lens is None:
        raise RuntimeError("encoder-decoder steps run packed, on the gather path")
    return position_ids - ctx.source_lens.view(1, -1)


def decoder_part(plan: StepPlan, sources: list[int]) -> tuple[StepPlan, list[int]]:
    """The plan's decoder tokens: each row's tokens from its source's end on (rows whose step
    covered source positions only are left out; they do not sample), with the kept rows'
    indexes. The step's own fields (`ranked`, and any added later) carry over; what `execute`
    already did (table edits, releases, copies, installs, the sources' writes) does not. Rows
    indexed by fields an encoder-decoder step never has (scores, deferred tokens, LoRA slots:
    refused at the front end or at start-up) stop it rather than point at the wrong rows."""
    if plan.scores or plan.deferred is not None or plan.lora_slots is not None:
        raise RuntimeError("an encoder-decoder step with scores, deferred tokens or LoRA slots")
    kept: list[int] = []
    starts: list[int] = []
    num_new: list[int] = []
    tokens: list[int] = []
    for r, (start, n, source, first) in enumerate(
        zip(plan.starts, plan.num_new, sources, plan.token_starts())
    ):
        skip = max(0, source - start)
        if skip < n:
            kept.append(r)
            starts.append(start + skip)
            num_new.append(n - skip)
            tokens += plan.tokens[first + skip : first + n]
        elif plan.samples[r]:
            raise RuntimeError(f"row {plan.row_ids[r]} samples inside its source")
    part = replace(
        plan,
        row_ids=[plan.row_ids[r] for r in kept],
        starts=starts,
        num_new=num_new,
        num_drafts=[plan.num_drafts[r] for r in kept],
        samples=[plan.samples[r] for r in kept],
        tokens=tokens,
        source_lens=[sources[r] for r in kept],
        source_groups=[plan.source_groups[r] for r in kept] if plan.source_groups else [],
        aligns=[i for i, r in enumerate(kept) if r in plan.aligns],
        table_edits=[],
        released=[],
        copies=[],
        installs=[],
        encodes=[],
    )
    return part, kept


def fits(step: DecodeStep) -> bool:
    """Whether the compiled graphs take a decode step: every row past its decoder's first token
    and every source two positions long at least (dynamo specializes a width of one)."""
    cross = step.cross
    return step.gather.shape[1] > 1 and cross is not None and cross.sources.gather.shape[1] > 1
