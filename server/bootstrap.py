"""Builds the serving stack from a ServerConfig: model directory, runner, engine, engine thread."""

from __future__ import annotations

import gc
import logging
import os
import time

import torch
from transformers import AutoTokenizer

from server.api.serving import ServingContext
from server.config import ServerConfig, with_device_defaults
from server.engine.async_engine import AsyncEngine
from server.engine.engine import Engine
from server.metrics import Metrics
from server.model.devices import pick_device, pick_dtype
from server.model.kv_budget import KVBudget
from server.model.loader import resolve_model_dir, served_model_name
from server.model.runner import ModelRunner

log = logging.getLogger(__name__)


def overlaps_outputs(setting: str, device_type: str) -> bool:
    """`overlap_outputs` auto: on CUDA, where the forward is queued and the host is free while the
    device computes; not on the CPU, where the forward holds the host (and a stop string would
    cost a dropped token for nothing)."""
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def build_serving_context(config: ServerConfig) -> ServingContext:
    """Load everything and start the engine loop. Never touches the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    device = pick_device(config.device)
    config = with_device_defaults(config, device.type)  # a no-op when `beamline serve` did it
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    log.info("torch intra-op threads: %d", torch.get_num_threads())
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
        quantization=config.quantization,
        linear_layout=config.linear_layout,
        attention_backend=config.attention_backend,
        compile_decode=config.torch_compile,
        cuda_graphs=config.cuda_graphs and device.type == "cuda",
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=False
    )
    name = config.served_model_name or served_model_name(config.model)
    metrics = Metrics(name)
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        metrics=metrics,
        enable_prefix_caching=config.enable_prefix_caching,
        overlap_outputs=overlaps_outputs(config.overlap_outputs, device.type),
    )
    async_engine = AsyncEngine(engine)
    started = time.monotonic()
    async_engine.start(warm_up=runner.warm_up)  # compiled and recorded where steps will run
    if config.torch_compile:
        log.info("decode step compiled in %.0f s", time.monotonic() - started)
    ctx = ServingContext(
        engine=async_engine,
        tokenizer=tokenizer,
        model_name=name,
        max_model_len=engine.max_model_len,
        vocab_size=runner.vocab_size,
        config=config,
        metrics=metrics,
    )
    started = time.monotonic()
    ctx.grammars.prepare()  # structured outputs' first request must not wait for this
    log.info("grammar tokenizer ready in %.1f s", time.monotonic() - started)
    log.info("serving %s from %s (max_model_len %d)", name, model_dir, engine.max_model_len)
    # Start-up leaves ~400k long-lived objects (torch, transformers, the tokenizer); a full
    # collection walks all of them, which stalled decode steps by 10-100 ms now and then
    # (benchmarks/engine_overhead.py: mean host time 12.3 ms -> 5.8 at 256 rows). Freezing moves
    # them out of the collector's generations, as vLLM does after start-up.
    gc.collect()
    gc.freeze()
    return ctx
