"""Runs one engine step through the model: pack tokens, call the decoder, LM head on sampled rows.

The model definition is transformers' own; attention and the KV cache are ours (see attention.py).
The same code runs on CUDA and CPU: only `device` (chosen once at start-up) differs.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from server.engine.attention import (
    ATTENTION_NAME,
    PagedKVCache,
    SeqSlice,
    StepContext,
    make_paged_attention,
)
from server.engine.cpu_linear import TransposedLinear, transpose_linears
from server.engine.quantization import quantize_decoder_weights, quantized_lm_head
from server.engine.sequence import Sequence

log = logging.getLogger(__name__)
_runner_ids = itertools.count()


@dataclass(frozen=True)
class WorkItem:
    """One sequence's share of a step: `num_new` tokens starting at its `num_computed`."""

    seq: Sequence
    num_new: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its last token predicts the next."""
        return self.seq.num_computed + self.num_new == len(self.seq.token_ids)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        quantization: str = "none",
        linear_layout: str = "auto",
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.config = getattr(config, "text_config", config)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, local_files_only=True, trust_remote_code=False
        )
        self.model = model.to(device).eval()
        self.decoder = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        self.vocab_size = head.weight.shape[0]
        self.lm_head = quantized_lm_head(head, device, quantization)
        if linear_layout not in ("auto", "transposed", "native"):
            raise ValueError(f"linear_layout must be auto, transposed or native; got {linear_layout!r}")
        if quantization == "int8-weights":
            quantize_decoder_weights(self.decoder, device)
        if linear_layout == "transposed" or (linear_layout == "auto" and device.type == "cpu"):
            transpose_linears(self.decoder)
            if self.lm_head is head:  # an untied copy: the embedding keeps the [vocab, hidden] table
                self.lm_head = TransposedLinear.from_linear(head)
        self.head_dtype = torch.float32 if quantization != "none" else dtype
        self.final_softcap = getattr(self.config, "final_logit_softcapping", None)

        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per_block = PagedKVCache.bytes_per_block(
            cfg.num_hidden_layers, block_size, kv_heads, head_dim, dtype
        )
        if num_blocks is None:
            if kv_cache_bytes is None:
                raise ValueError("give either num_blocks or kv_cache_bytes")
            num_blocks = kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget too small: one block needs {per_block} bytes")
        self.num_blocks = int(num_blocks)
        self.kv_cache = PagedKVCache(
            cfg.num_hidden_layers, self.num_blocks, block_size, kv_heads, head_dim, dtype, device
        )
        # One registered name per runner: the function is bound to this runner's own KV cache, so
        # several engines in one process (tests, benchmarks) never write into each other's pools.
        name = f"{ATTENTION_NAME}_{next(_runner_ids)}"
        AttentionInterface.register(name, make_paged_attention(self.kv_cache))
        self.model.set_attn_implementation(name)
        log.info(
            "model on %s (%s): %d KV blocks of %d tokens (%.1f MiB)",
            device, dtype, self.num_blocks, block_size, self.num_blocks * per_block / 2**20,
        )

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def _slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat cache slots of positions [start, stop) of a sequence with block table `table`."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def execute(self, items: list[WorkItem], copies: list[tuple[int, int]]) -> torch.Tensor:
        """Run `items` as one forward pass; return logits [R, V] for the items that sample, in order."""
        self.kv_cache.copy_blocks(copies)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        decode: list[SeqSlice] = []
        prefill: list[SeqSlice] = []
        sample_rows: list[int] = []
        for item in items:
            seq, start = item.seq, item.seq.num_computed
            stop = start + item.num_new
            first = len(tokens)
            tokens.extend(seq.token_ids[start:stop])
            positions.extend(range(start, stop))
            history = self._slots(seq.block_table, 0, stop)
            slots.append(history[start:])
            sl = SeqSlice(first, item.num_new, stop, history.to(self.device))
            (decode if item.num_new == 1 else prefill).append(sl)
            if item.samples:
                sample_rows.append(len(tokens) - 1)
        ctx = StepContext(
            slot_mapping=torch.cat(slots).to(self.device),
            decode=decode,
            prefill=prefill,
            device=self.device,
        )
        input_ids = torch.tensor([tokens], device=self.device)
        position_ids = torch.tensor([positions], device=self.device)
        hidden = self.decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=None,
            use_cache=False,
            beamline_ctx=ctx,
        ).last_hidden_state[0]
        if not sample_rows:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.lm_head(hidden[rows].to(self.head_dtype)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
