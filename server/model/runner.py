"""Runs one engine step through the model: pack tokens, call the decoder, LM head on sampled rows.

The model definition is transformers' own; attention and the KV cache are ours (see attention.py).
One code path serves CUDA and the CPU, with the device chosen once at start-up; what differs is
set up here: the default dtype (bfloat16 on CUDA, float32 on the CPU), the CPU-only weight layouts
and int8 quantizations (cpu_linear.py, quantization.py), and CUDA graphs of decode steps
(cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from decoding.transfer import to_device
from server.model.attention import ATTENTION_NAME
from server.model.background_compile import BackgroundCompile
from server.model.compiled_decode import decode_forward
from server.model.compiled_steps import CompiledSteps
from server.model.cuda_graphs import DecodeGraphs
from server.model.decode_step import DecodeStepInUse
from server.model.devices import check_runner_options, pick_attention_backend
from server.model.kv_budget import (
    KVBudget,
    decode_plan_of,
    plan_num_blocks,
    sampler_workload,
    worst_case_plan,
)
from server.model.kv_pool import AttentionBinding, KVLayout, paged_kernel
from server.model.packing import (
    decode_inputs,
    pack_step,
    put_deferred,
    score_positions,
    scratch_decode,
    scratch_plan,
    verify_inputs,
)
from server.model.paged_step import PagedStep
from server.model.quantization import EXACT_LOGITS, head_logits
from server.model.row_tables import RowTables
from server.model.step_context import DecodeStep, StepContext
from server.model.weights import load_serving_weights, text_config
from server.parallel.group import TPGroup
from server.parallel.plan_broadcast import StepBroadcast
from server.step_plan import StepOutput, StepPlan

log = logging.getLogger(__name__)
_runner_ids = itertools.count()
# Prompt positions per LM-head call when scoring a prompt: the logits of a whole 512-token chunk
# over a 262k vocabulary would be half a gigabyte; 64 positions are 64 MiB (fp32), reduced to the
# requested top-k before the next 64.


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The model's end-of-sequence ids: its generation config's and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


class ModelRunner:
    encoder_decoder = False  # its rows hold a source first (model/seq2seq/runner.py)

    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int | None = None,
        kv_budget: KVBudget | None = None,
        quantization: str = "none",
        linear_layout: str = "auto",
        compile_decode: bool = False,
        compile_cache: Path | None = None,
        cuda_graphs: bool = False,
        attention_backend: str = "gather",
        max_loras: int = 0,
        max_lora_rank: int = 16,
        tp: TPGroup | None = None,
        compile_while_serving: BackgroundCompile | None = None,
        weights_cache: Path | None = None,
    ) -> None:
        check_runner_options(compile_decode, quantization, device)  # before minutes of loading
        if tp and cuda_graphs:  # NCCL inside a graph capture is not verified on a GPU yet
            log.warning("tensor parallelism is on: decode steps run without CUDA graphs")
            cuda_graphs = False
        self.device, self.dtype, self.quantization = device, dtype, quantization
        self.block_size = block_size
        self.attention_backend = pick_attention_backend(attention_backend, device, compile_decode)
        self.config = text_config(model_dir)
        self.max_position_embeddings = int(getattr(self.config, "max_position_embeddings", 2048))
        self.tp = tp
        self.pad_cross = False  # an encoder-decoder's compiled step pads; read by profile steps
        weights = load_serving_weights(
            model_dir,
            device=device,
            dtype=dtype,
            quantization=quantization,
            linear_layout=linear_layout,
            compiled=compile_decode,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            tp=tp,
            weights_cache=weights_cache,
        )
        self.model, self.lm_head, self.lora = weights.model, weights.lm_head, weights.lora
        self.exact = weights.exact  # a scoring prompt's tokens at full precision
        self.decoder = self.model.get_decoder()
        self.vocab_size, self.linear_layout = weights.vocab_size, weights.linear_layout
        self.head_dtype = torch.float32 if quantization != "none" else dtype
        self.final_softcap = getattr(self.config, "final_logit_softcapping", None)

        # The pool is sized once the weights are final (loaded, quantized, transposed).
        self.kv_budget = kv_budget or KVBudget()
        self.kv_layout = KVLayout.of(self.config, block_size, dtype, ranks=tp.size if tp else 1)
        self.attention = AttentionBinding(
            f"{ATTENTION_NAME}_{next(_runner_ids)}", paged_kernel(self.attention_backend)
        )
        # CUDA graphs of decode steps need the paged kernel: their shape is then the row count's
        # alone (cuda_graphs.py). Padding rows write into one extra block no sequence owns.
        self.cuda_graphs = cuda_graphs and self.attention_backend == "triton"
        self.num_blocks = plan_num_blocks(
            self.kv_budget,
            num_blocks=num_blocks,
            bytes_per_block=self.kv_layout.bytes_per_block + self.kv_budget.shared_bytes_per_block,
            block_size=block_size,
            device=device,
            max_model_len=self.kv_budget.max_model_len or self.max_position_embeddings,
            profile=self.profile_worst_step,
        )
        if tp is not None:  # every rank sized its own pool: the block tables fit the smallest
            self.num_blocks = tp.min_int(self.num_blocks)
        graphs = self.cuda_graphs
        # a spare block no sequence owns: CUDA graphs' padding rows, compiled steps' examples
        spare = int(graphs or compile_decode)
        self.kv_cache = self.kv_layout.allocate(self.num_blocks + spare, device)
        self.rows = RowTables()  # each row's block table, kept between plans
        self.attention.bind(self.model, self.kv_cache)
        max_len = self.kv_budget.max_model_len or self.max_position_embeddings
        self.graphs = (
            DecodeGraphs(
                lambda ids, pos, step: self._logits(self._run_decoder(ids, pos, step)),
                max_rows=self.kv_budget.max_num_seqs,
                max_blocks=min(self.num_blocks, -(-max_len // block_size)),
                block_size=block_size,
                scratch_block=self.num_blocks,
                device=device,
                lora=self.lora,
            )
            if graphs
            else None
        )
        log.info(
            "model on %s (%s): %d KV blocks of %d tokens (%.1f MiB), %s attention",
            device,
            dtype,
            self.num_blocks,
            block_size,
            self.num_blocks * self.kv_layout.bytes_per_block / 2**20,
            self.attention_backend,
        )
        self.compile_decode = compile_decode
        self.compiled_decode: CompiledSteps | None = None
        if compile_decode:
            self.compiled_decode = CompiledSteps(
                self.decoder,
                model_dir,
                compile_cache,
                self.lora,
                device=device.type,
                dtype=str(dtype),
                quantization=quantization,
                linear_layout=self.linear_layout,
                block_size=str(block_size),
                lora=f"{max_loras} slots, rank {max_lora_rank}" if max_loras else "none",
                # each rank's shard is its own graph: its vocabulary range is a constant in it
                tensor_parallel=f"rank {tp.rank} of {tp.size}" if tp else "none",
            )
        examples = functools.partial(scratch_decode, block_size=block_size, device=device)
        on_spare = functools.partial(examples, block=self.num_blocks, kv=self.kv_cache)
        self.decode_step = DecodeStepInUse(  # decode_step.py: eager, or compiled
            self._run_decoder, self.compiled_decode, on_spare, compile_while_serving
        )
        # the plans, to the other ranks (installs name the projections in this order)
        self.tp_steps = StepBroadcast.of_driver(tp, list(self.lora.targets) if self.lora else [])

    def _run_decoder(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        ctx: StepContext | DecodeStep | PagedStep,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed tokens (eagerly, the compiled step's code)."""
        return decode_forward(self.decoder, input_ids, position_ids, ctx)

    def _logits(self, x: torch.Tensor, ranked: int = 0, exact: Sequence[int] = ()) -> torch.Tensor:
        """StepPlan's `ranked` and `exact_logits`, as quantization.head_logits takes them."""
        logits = head_logits(self.lm_head, x.to(self.head_dtype), ranked, exact)
        if self.tp is not None:  # this rank's vocabulary: the driver gathers every rank's
            logits = self.tp.gather_vocab(logits, self.vocab_size)  # in the head's dtype
        logits = logits.float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.inference_mode()
    def profile_worst_step(self) -> int:
        """Peak activation bytes (0 on the CPU) of the worst step the engine can schedule
        (kv_budget.worst_case_items: prefill, LM head, sampler) over a pool just big enough."""
        max_len = self.kv_budget.max_model_len or self.max_position_embeddings
        plan, blocks = worst_case_plan(self.kv_budget, max_len, self.block_size)
        step = lambda: sampler_workload(self._standalone(plan).logits)  # noqa: E731
        peak = self.attention.profile(self.model, self.kv_layout, blocks, self.device, step)
        if self.cuda_graphs:  # the graphs' memory pool stays while serving: reserve the largest
            rows = decode_plan_of(self.kv_budget.max_num_seqs)
            peak += self.attention.profile(
                self.model, self.kv_layout, len(rows), self.device, lambda: self._standalone(rows)
            )
        return peak

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before serving, in the thread that will step: compile the attention kernel's variants,
        capture the decode graphs, or load or compile the decode step and run it once with one
        row and with two."""
        if self.attention_backend == "triton":
            for num_new in (1, 2):  # decode tiles, then chunk tiles (every layer kind runs)
                self._standalone(scratch_plan(num_new, self.block_size))
        if self.graphs is not None:
            self.graphs.capture()
        self.decode_step.warm_up()

    def _decode_step(
        self,
        tables: list[list[int]],
        tokens: list[int],
        positions: list[int],
        plan: StepPlan,
        edit_tokens: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """Logits [B, V] of B rows that each add `tokens[b]` at `positions[b]` (gather path),
        read as `plan` asks; `edit_tokens` may change the tokens on the device first."""
        lengths = [p + 1 for p in positions]
        ctx = DecodeStep.build(tables, lengths, self.block_size, self.device)
        input_ids = to_device(tokens, self.device, torch.long).unsqueeze(0)
        edit_tokens(input_ids[0])
        position_ids = to_device(positions, self.device, torch.long).unsqueeze(0)
        ctx.kv = self.kv_cache  # the compiled step takes the pools as an input
        hidden = self.decode_step(input_ids, position_ids, ctx)
        return self._logits(hidden, plan.ranked, plan.exact_logits)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run `plan` as one forward pass: logits of the rows that sample, in order, and the
        logprobs of the positions its rows ask to score. Its installs, table edits and block
        copies come first; its deferred tokens (the previous step's choices, not read back yet)
        are taken on the device."""
        if self.tp_steps is not None:  # the other ranks run the same plan
            self.tp_steps.step(plan)
        for install in plan.installs:
            if self.lora is None:
                raise RuntimeError("a LoRA adapter install on a model without LoRA slots")
            self.lora.install(install)
        tables = self.rows.apply(plan)
        self.kv_cache.copy_blocks(plan.copies)
        if not plan.row_ids:  # this model runs none of the step's rows (engine/fusion.py)
            return StepOutput(torch.empty((0, self.vocab_size), device=self.device))
        adapters = self.lora.applied(plan) if self.lora else contextlib.nullcontext()
        with self.decode_step.clock.forward(), adapters:  # the clock: background_compile.py
            return self._execute(plan, tables)

    def _execute(self, plan: StepPlan, tables: list[list[int]]) -> StepOutput:
        if plan.verify_only and not plan.exact:
            edit: Callable[[torch.Tensor], None] = lambda t: None  # noqa: E731
            if plan.deferred is not None:
                edit = functools.partial(put_deferred, plan=plan, row_starts=plan.token_starts())
            decode = plan.decode_only
            if decode and self.graphs is not None and self.graphs.fits(tables):
                logits = self.graphs.run(*decode_inputs(plan, tables), edit)
                return StepOutput(logits, reused=True)  # the next replay overwrites them
            if self.attention_backend != "triton":  # drafts: one decode query row each
                inputs = decode_inputs(plan, tables) if decode else verify_inputs(plan, tables)
                return StepOutput(self._decode_step(*inputs, plan, edit))
        return self._execute_packed(plan, tables)

    def _standalone(self, plan: StepPlan) -> StepOutput:
        """A plan whose edits hold its rows' whole tables, run packed and not kept (warm-up,
        profile: packing.standalone_plan)."""
        return self._execute_packed(plan, [edit.blocks for edit in plan.table_edits])

    def _execute_packed(self, plan: StepPlan, tables: list[list[int]]) -> StepOutput:
        """The general path: tokens of every row packed as one sequence (prefill chunks,
        mixed)."""
        kernel = self.attention_backend == "triton"
        packed = pack_step(plan, tables, self.block_size, self.device, kernel, self.pad_cross)
        put_deferred(packed.input_ids[0], plan, packed.row_starts)
        with self.exact.rows(plan, packed.row_starts, self.device):  # a scoring prompt's
            hidden = self._run_decoder(packed.input_ids, packed.position_ids, packed.ctx)
        exact = functools.partial(self._logits, ranked=EXACT_LOGITS)  # read as logprobs
        scores = {
            score.row: scored
            for score in plan.scores
            if (scored := score_positions(hidden, packed, plan, score, exact)) is not None
        }
        if not packed.sample_rows:
            return StepOutput(hidden.new_empty((0, self.vocab_size), dtype=torch.float32), scores)
        rows = hidden[packed.sample_index]
        return StepOutput(self._logits(rows, plan.ranked, plan.exact_logits), scores)
