"""How many KV blocks to allocate: a fixed size, or "auto" (what the device has left).

On CUDA, "auto" sizes the pool as vLLM's `gpu_memory_utilization` and SGLang's
`mem_fraction_static` do: after the weights are loaded and one step of the worst case the engine
can schedule has run (its activations, the LM head on the widest batch of rows and the sampler's
working memory measured at their peak), the pool gets

    utilization x total device memory - memory in use (weights, CUDA context, other processes)
                                      - the worst step's peak activation memory

On the CPU, "auto" is a fixed 1 GiB: host RAM is shared with everything else on the machine and
there is no allocator to measure a peak with.

The arithmetic and the choice are plain functions; device memory is read through an injectable
`MemInfo`, so that tests fake a GPU on the CPU. The worst-case step's rows and sampler work are
built here too; the runner runs them (`ModelRunner.profile_worst_step`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from decoding import DecodingParams, SamplingTensors, sample, token_logprobs
from server.model.packing import standalone_plan
from server.step_plan import StepPlan

log = logging.getLogger(__name__)
GiB = 1024**3
CPU_AUTO_KV_BYTES = GiB  # "auto" on the CPU
# The sampler's profile rows: half of them top-k + top-p (what most clients send), the other half
# top-p alone, which sorts the whole vocabulary (the largest working set of the warpers), and all
# of them ask for top logprobs (a log_softmax copy of the logits beside the processed scores).
PROFILE_TOP_K, PROFILE_TOP_P, PROFILE_LOGPROBS = 50, 0.9, 20

MemInfo = Callable[[torch.device], tuple[int, int]]  # (free, total) bytes of a device


def cuda_mem_info(device: torch.device) -> tuple[int, int]:
    """Free and total bytes of a CUDA device, as the driver sees them (all processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass(frozen=True)
class KVBudget:
    """What sizes the KV pool when no block count is given, with the engine limits that bound
    the worst step (the runner takes this, not the server config, to keep the layers apart)."""

    kv_cache_bytes: int | Literal["auto"] = "auto"
    gpu_memory_utilization: float = 0.9  # fraction of device memory this process may fill
    max_num_seqs: int = 64  # rows of one step: the LM head and the sampler run on these
    max_num_batched_tokens: int = 512  # tokens of one step
    max_model_len: int | None = None  # None: the model's own context length
    # the KV bytes other models keep per block of this pool (LM fusion's companions hold the
    # same block ids in pools of their own: engine/fusion.py)
    shared_bytes_per_block: int = 0
    # device bytes loaded after the pool is sized: the extra models' weights (runner_setup.py)
    reserved_bytes: int = 0


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes measured on the device: its size, what is in use once the model is loaded (and
    the profile step's memory released), and the profile step's peak above that."""

    total: int
    used: int
    peak_activation: int

    def kv_bytes(self, utilization: float) -> int:
        """What is left for the KV pool (negative when even the model does not fit)."""
        return int(utilization * self.total) - self.used - self.peak_activation


def auto_num_blocks(memory: DeviceMemory, utilization: float, bytes_per_block: int) -> int:
    """(utilization x total - used - peak activation) // bytes per block, never below 0."""
    return max(memory.kv_bytes(utilization), 0) // bytes_per_block


def plan_num_blocks(
    budget: KVBudget,
    *,
    num_blocks: int | None,
    bytes_per_block: int,
    block_size: int,
    device: torch.device,
    max_model_len: int,
    profile: Callable[[], int],
    mem_info: MemInfo = cuda_mem_info,
) -> int:
    """The pool's size in blocks: `num_blocks` if given, else `budget.kv_cache_bytes`, else
    (auto) 1 GiB on the CPU or, on CUDA, what `profile` (runs the worst step, returns its peak
    bytes and releases them) and `mem_info` leave. `max_model_len` is the context one sequence
    may reach: an auto-sized pool that cannot hold one such sequence is refused; a smaller pool
    set by size or block count lowers it (the engine caps it there), and the log says so."""
    blocks = _plan(
        budget, num_blocks, bytes_per_block, block_size, device, max_model_len, profile, mem_info
    )
    pool = f"{blocks:,} blocks of {block_size} tokens, {blocks * bytes_per_block / GiB:.2f} GiB"
    log.info(context_limit(budget, max_model_len, blocks * block_size, pool, num_blocks, device))
    return blocks


def context_limit(
    budget: KVBudget,
    max_model_len: int,
    pool_tokens: int,
    pool: str,
    num_blocks: int | None,
    device: torch.device,
) -> str:
    """Why the context limit is what it is: max_model_len (the flag's, else the model's), or
    less when the pool holds fewer tokens than that for one sequence."""
    if pool_tokens >= max_model_len:
        source = "--max-model-len" if budget.max_model_len else "the model's context length"
        return f"max_model_len {max_model_len:,} tokens: {source} (the KV pool: {pool})"
    if num_blocks is not None:
        sized_by = "num_kv_blocks"
    elif budget.kv_cache_bytes != "auto":
        sized_by = "kv_cache_memory"
    else:
        sized_by = "kv_cache_memory auto" + (" = 1 GiB on the CPU" if device.type != "cuda" else "")
    asked = "--max-model-len asks" if budget.max_model_len else "the model allows"
    return (
        f"max_model_len {pool_tokens:,} tokens: what the KV pool ({pool}: {sized_by}) holds for "
        f"one sequence ({asked} {max_model_len:,}); --kv-cache-memory or --max-model-len to "
        "change"
    )


def _plan(
    budget: KVBudget,
    num_blocks: int | None,
    bytes_per_block: int,
    block_size: int,
    device: torch.device,
    max_model_len: int,
    profile: Callable[[], int],
    mem_info: MemInfo,
) -> int:
    if num_blocks is not None:
        return _at_least_one_block(num_blocks, bytes_per_block)
    if budget.kv_cache_bytes != "auto":
        return _at_least_one_block(budget.kv_cache_bytes // bytes_per_block, bytes_per_block)
    if device.type != "cuda":
        return _at_least_one_block(CPU_AUTO_KV_BYTES // bytes_per_block, bytes_per_block)
    peak = profile()
    free, total = mem_info(device)  # after the profile: CUDA context and kernels loaded
    used = total - free + budget.reserved_bytes  # the extra models' weights load after this
    memory = DeviceMemory(total=total, used=used, peak_activation=peak)
    blocks = auto_num_blocks(memory, budget.gpu_memory_utilization, bytes_per_block)
    needed = -(-max_model_len // block_size)  # blocks of one sequence of max_model_len tokens
    if blocks < max(needed, 1):
        raise ValueError(
            _does_not_fit(budget, memory, bytes_per_block, blocks, max_model_len, needed)
        )
    log.info(
        "KV cache (auto) on %s: %.2f x %.2f GiB total - %.2f GiB in use after loading (extra "
        "models' weights included) - "
        "%.2f GiB peak activation (%d tokens, %d rows) = %.2f GiB: %d blocks of %d tokens",
        device,
        budget.gpu_memory_utilization,
        total / GiB,
        memory.used / GiB,
        peak / GiB,
        budget.max_num_batched_tokens,
        budget.max_num_seqs,
        blocks * bytes_per_block / GiB,
        blocks,
        block_size,
    )
    return blocks


def _at_least_one_block(num_blocks: int, bytes_per_block: int) -> int:
    if num_blocks < 1:
        raise ValueError(f"KV cache budget too small: one block needs {bytes_per_block} bytes")
    return int(num_blocks)


def _does_not_fit(
    budget: KVBudget,
    memory: DeviceMemory,
    bytes_per_block: int,
    blocks: int,
    max_model_len: int,
    needed: int,
) -> str:
    left = memory.kv_bytes(budget.gpu_memory_utilization)
    return (
        f"the KV cache does not fit: gpu_memory_utilization {budget.gpu_memory_utilization} x "
        f"{memory.total / GiB:.2f} GiB total - {memory.used / GiB:.2f} GiB in use after loading "
        f"the model - {memory.peak_activation / GiB:.2f} GiB peak activation of the worst step "
        f"(max_num_batched_tokens {budget.max_num_batched_tokens}, max_num_seqs "
        f"{budget.max_num_seqs}) leaves {left / GiB:.2f} GiB = {blocks} KV blocks of "
        f"{bytes_per_block / 2**20:.2f} MiB, but one sequence of max_model_len "
        f"{max_model_len} tokens needs {needed}. "
        "Lower max_num_batched_tokens / max_num_seqs, raise gpu_memory_utilization, lower "
        "max_model_len, or set kv_cache_memory to a size"
    )


def profile_lengths(num_tokens: int, max_rows: int, max_len: int) -> list[int]:
    """Prompt lengths of the worst step: `num_tokens` tokens in as many rows as the engine may
    run (every row samples, so the LM head and the sampler see the most rows), one token each,
    the rest piled onto the first rows up to `max_len` (one long prompt: the largest attention)."""
    lengths = [1] * min(max_rows, num_tokens)
    left = num_tokens - len(lengths)
    for i in range(len(lengths)):
        extra = min(left, max_len - 1)
        lengths[i] += extra
        left -= extra
    return lengths


def worst_case_plan(budget: KVBudget, max_len: int, block_size: int) -> tuple[StepPlan, int]:
    """The worst step as whole prompts over a fresh pool, and the blocks they use."""
    lengths = profile_lengths(budget.max_num_batched_tokens, budget.max_num_seqs, max_len)
    tables: list[list[int]] = []
    used = 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(used, used + blocks)))
        used += blocks
    return standalone_plan(lengths, tables), used


def decode_plan_of(rows: int) -> StepPlan:
    """A decode step of `rows` rows, one block each (what the largest CUDA graph runs)."""
    return standalone_plan([1] * rows, [[r] for r in range(rows)])


def sampler_workload(logits: torch.Tensor) -> None:
    """Process and sample `logits` [rows, vocab] as the engine would with the costliest common
    settings (see PROFILE_TOP_K); the global RNG is left as it was."""
    rows, vocab = logits.shape
    params = [
        DecodingParams(
            temperature=0.8,
            top_k=PROFILE_TOP_K if r % 2 else 0,
            top_p=PROFILE_TOP_P,
            logprobs=PROFILE_LOGPROBS,
        )
        for r in range(rows)
    ]
    prompts = [[0]] * rows
    devices = [logits.device] if logits.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        t = SamplingTensors.from_rows(
            params, prompts, [[]] * rows, frozenset(), vocab, logits.device
        )
        _, tokens = sample(logits, t)
        token_logprobs(logits, tokens, num_top=PROFILE_LOGPROBS)


def measure_peak(device: torch.device, step: Callable[[], object]) -> int:
    """Run `step`; on CUDA return the most bytes it held allocated at once beyond what was
    allocated before it. Elsewhere there is no allocator to ask: the step runs (so that its code
    path is exercised) and 0 is returned."""
    if device.type != "cuda":
        step()
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)) - int(before)
