"""Loads the model side of a server from its config: device, runner (weights, KV pool), tokenizer
and the engine over them. The same code runs in the server's process (engine thread) and in an
engine process of its own (server/process/worker.py)."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server.config import ServerConfig
from server.device_defaults import with_device_defaults
from server.engine.engine import Engine
from server.model.devices import (
    compiler_available,
    pick_device,
    pick_dtype,
    resolve_quantization,
    resolve_torch_compile,
)
from server.model.kv_budget import KVBudget
from server.model.loader import default_cache_dir, resolve_model_dir
from server.model.runner import ModelRunner

log = logging.getLogger(__name__)


def overlaps_outputs(setting: str, device_type: str) -> bool:
    """`overlap_outputs` auto: on CUDA, where the forward is queued and the host is free while the
    device computes; not on the CPU, where the forward holds the host (and a stop string would
    cost a dropped token for nothing)."""
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def schedules_async(setting: str, device_type: str) -> bool:
    """`async_scheduling` auto: on CUDA, where the host can plan the next step while the device
    computes; not on the CPU, where the forward holds the host (and finishing tokens would cost
    a dropped row for nothing)."""
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)


@dataclass
class LoadedEngine:
    engine: Engine
    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    config: ServerConfig  # with the device's defaults applied


def load_engine(config: ServerConfig) -> LoadedEngine:
    """Load weights, size the KV pool and build the engine (not started, no metrics yet). Never
    touches the network: a hub model's files were fetched before the port opened
    (bootstrap.prepare_model), and from here on everything loads from local paths, in this process
    and in an engine process (which inherits the variable)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    device = pick_device(config.device)
    config = with_device_defaults(config, device.type)  # a no-op when `beamline serve` did it
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    log.info("torch intra-op threads: %d", torch.get_num_threads())
    quantization = resolve_quantization(config.quantization, config.dtype, device)
    compile_decode = resolve_torch_compile(
        config.torch_compile, config.quantization, quantization, device
    )
    if config.quantization == "auto" and device.type == "cpu":
        log.info("CPU default: %s", cpu_default_summary(quantization, compile_decode, device))
    compile_cache = (config.cache_dir or default_cache_dir()) / "compiled"
    if compile_decode:  # inductor's kernels too, unless its cache is set elsewhere
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
    runner = ModelRunner(
        model_dir,
        device=device,
        dtype=pick_dtype(config.dtype, device),
        block_size=config.block_size,
        num_blocks=config.num_kv_blocks,
        kv_budget=KVBudget(
            kv_cache_bytes=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        ),
        quantization=quantization,
        linear_layout=config.linear_layout,
        attention_backend=config.attention_backend,
        compile_decode=compile_decode,
        compile_cache=compile_cache,
        cuda_graphs=config.cuda_graphs and device.type == "cuda",
        max_loras=config.max_loras if config.lora_enabled else 0,
        max_lora_rank=config.max_lora_rank,
    )
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        overlap_outputs=overlaps_outputs(config.overlap_outputs, device.type),
        async_scheduling=schedules_async(config.async_scheduling, device.type),
        speculative_tokens=config.num_speculative_tokens,
        max_cpu_loras=config.max_cpu_loras,
    )
    for (
        name,
        source,
    ) in config.lora_adapters().items():  # lora_files.AdapterError says what is wrong
        engine.load_adapter(name, source)
    return LoadedEngine(engine, runner, tokenizer, model_dir, config)


def cpu_default_summary(quantization: str, compiled: bool, device: torch.device) -> str:
    """What `quantization auto` and an empty `torch_compile` chose on this CPU, and why."""
    if quantization != "w8a8":
        return (
            "fp32, exact (no int8 dot-product instructions on this CPU, or an explicit --dtype); "
            "--quantization w8a8 --torch-compile is the fast CPU setting"
        )
    said = "w8a8 (int8 GEMMs, the LM head's top candidates re-scored exactly)"
    if compiled:
        said += ", decode step compiled (about 1.5 min at a first start; later starts load it)"
    elif not compiler_available(device):
        said += ", not compiled: inductor needs a C++ compiler on PATH (g++ adds 1.3-1.5x)"
    return said + "; --dtype float32 is the exact mode"


def freeze_start_up_objects() -> None:
    """Start-up leaves ~400k long-lived objects (torch, transformers, the tokenizer); a full
    collection walks all of them, which stalled decode steps by 10-100 ms now and then
    (benchmarks/engine_overhead.py: mean host time 12.3 ms -> 5.8 at 256 rows). Freezing moves
    them out of the collector's generations, as vLLM does after start-up."""
    gc.collect()
    gc.freeze()
