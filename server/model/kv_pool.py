"""The model side's KV pool: its shape from the model config, its allocation, and the attention
function bound to it.

Kept apart from runner.py because the pool is built twice when it is sized from device memory
(kv_budget.py): a small one for the profile step, then the real one, each bound in turn to the
runner's attention name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from server.model.attention import PagedKernel, make_paged_attention
from server.model.kv_budget import measure_peak
from server.model.kv_cache import PagedKVCache


@dataclass(frozen=True)
class KVLayout:
    """What one KV block holds: every layer's keys and values for `block_size` tokens."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, block_size: int, dtype: torch.dtype, ranks: int = 1) -> KVLayout:
        """From a transformers text config (head_dim and KV heads have fallbacks: not every
        architecture names them; an encoder-decoder model's are its decoder's, whose layers keep
        the source's cross-attention keys and values in the same pool); under tensor
        parallelism one rank's share of the KV heads (one head when there are fewer than ranks:
        it is replicated)."""
        if getattr(config, "is_encoder_decoder", False):  # the decoder's layers hold the pool
            heads = int(getattr(config, "decoder_attention_heads", None) or config.num_heads)
            layers = int(getattr(config, "decoder_layers", None) or config.num_decoder_layers)
            head_dim = int(getattr(config, "d_kv", None) or int(config.d_model) // heads)
            return cls(layers, block_size, max(heads // ranks, 1), head_dim, dtype)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        kv_heads = max(int(kv_heads) // ranks, 1)
        return cls(int(config.num_hidden_layers), block_size, kv_heads, int(head_dim), dtype)

    @property
    def bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(
            self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.dtype
        )

    def allocate(self, num_blocks: int, device: torch.device) -> PagedKVCache:
        """A zeroed pool of `num_blocks`."""
        return PagedKVCache(
            self.num_layers,
            num_blocks,
            self.block_size,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            device,
        )


def paged_kernel(backend: str) -> PagedKernel | None:
    """The kernel that serves `PagedStep` contexts; triton is imported only when chosen."""
    if backend != "triton":
        return None
    from server.model import triton_attention

    return triton_attention.paged_attention


@dataclass
class AttentionBinding:
    """The attention name a runner's model is set to, the kernel behind it and the pool it is
    bound to. One name per runner: several engines in one process (tests, benchmarks) never
    write into each other's pools."""

    name: str
    kernel: PagedKernel | None
    cache: PagedKVCache | None = None

    def bind(self, model: PreTrainedModel, cache: PagedKVCache) -> None:
        """Make `model` attend over `cache`. Registering the name again rebinds it (transformers
        looks the function up on every forward)."""
        AttentionInterface.register(self.name, make_paged_attention(cache, self.kernel))
        model.set_attn_implementation(self.name)
        # transformers 5.17's sets the model's own config only (5.24's reaches them all), and T5's
        # encoder and decoder stacks keep copies: their layers would attend with SDPA
        for module in model.modules():
            config = getattr(module, "config", None)
            if type(config) is type(model.config) and config is not model.config:
                config._attn_implementation = self.name
        self.cache = cache

    def unbind(self) -> None:
        """Drop the registered function's pool (so its memory can be freed) until the next bind."""

        def unbound(*_: object, **__: object) -> tuple[torch.Tensor, None]:
            raise RuntimeError("the KV cache of this runner is not allocated")

        AttentionInterface.register(self.name, unbound)
        self.cache = None

    def profile(
        self,
        model: PreTrainedModel,
        pool: KVLayout,
        num_blocks: int,
        device: torch.device,
        step: Callable[[], object],
    ) -> int:
        """Peak bytes of `step` (`measure_peak`) run over a temporary pool of `num_blocks`,
        which is released afterwards (on CUDA handed back to the device); the pool bound before,
        if any, is bound again."""
        previous = self.cache
        self.bind(model, pool.allocate(num_blocks, device))
        try:
            return measure_peak(device, step)
        finally:
            self.unbind()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if previous is not None:
                self.bind(model, previous)
