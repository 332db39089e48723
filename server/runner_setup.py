"""A model runner from the server's config, the same way on every rank: the driver's (in the
engine's process) and each tensor-parallel follower's (server/parallel/workers.py)."""

from __future__ import annotations

import json
import logging
import os
from math import prod
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from server.config import ServerConfig
from server.host_memory import keep_freed_memory
from server.model.architecture import is_seq2seq
from server.model.background_compile import BackgroundCompile
from server.model.devices import (
    compiler_available,
    pick_dtype,
    resolve_quantization,
    resolve_torch_compile,
)
from server.model.kv_budget import KVBudget
from server.model.kv_pool import KVLayout
from server.model.loader import default_cache_dir
from server.model.runner import ModelRunner
from server.model.seq2seq.runner import Seq2SeqRunner
from server.model.seq2seq.target_lm import TargetLM
from server.model.weights import text_config
from server.parallel.group import TPGroup

log = logging.getLogger(__name__)
COMPILE_POOL_BLOCKS = 4  # the compile process's KV pool: its example steps use one block


def build_runner(
    config: ServerConfig, model_dir: Path, device: torch.device, tp: TPGroup | None = None
) -> ModelRunner:
    """Load the weights (this rank's share under `tp`) and size the KV pool."""
    dtype = pick_dtype(config.dtype, device)
    if device.type == "cpu":  # a CPU step's big tensors on pages already touched
        keep_freed_memory()
    pool: dict[str, Any] = dict(  # what every runner is given
        device=device,
        dtype=dtype,
        block_size=config.block_size,
        num_blocks=config.num_kv_blocks,
        kv_budget=KVBudget(
            kv_cache_bytes=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            shared_bytes_per_block=extra_kv_bytes(config, dtype),
            reserved_bytes=extra_weight_bytes(config, dtype) if device.type == "cuda" else 0,
        ),
    )
    cache = config.cache_dir or default_cache_dir()
    compile_cache = cache / "compiled"
    pool["weights_cache"] = cache / "weights"
    if is_seq2seq(text_config(model_dir)):
        check_seq2seq_options(config, text_config(model_dir).model_type == "whisper")
        # auto: float32, exact (int8's accuracy on these families is not measured yet); the
        # decode step compiled only when asked for (it changes the last bits of float32 sums)
        int8_format = "none" if config.quantization == "auto" else config.quantization
        compiled = bool(config.torch_compile)
        log.info(
            "encoder-decoder model: %s steps in %s (quantization %s), gather attention",
            "compiled decode" if compiled else "eager",
            dtype,
            int8_format,
        )
        if compiled:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
        return Seq2SeqRunner(
            model_dir,
            **pool,
            linear_layout=config.linear_layout,
            quantization=int8_format,
            compile_decode=compiled,
            compile_cache=compile_cache,
        )
    quantization = resolve_quantization(config.quantization, config.dtype, device)
    compile_decode = resolve_torch_compile(
        config.torch_compile, config.quantization, quantization, device
    )
    if config.quantization == "auto" and device.type == "cpu" and (tp is None or tp.is_driver):
        log.info("CPU default: %s", cpu_default_summary(quantization, compile_decode, device))
    if compile_decode:  # inductor's kernels too, unless its cache is set elsewhere
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
    beside_serving = None  # compiled while serving: a process of its own builds this runner
    if compile_decode and config.compile_while_serving and device.type == "cpu" and tp is None:
        spec = compile_spec(config, model_dir, torch.get_num_threads())
        beside_serving = BackgroundCompile(spec)
    return ModelRunner(
        model_dir,
        **pool,
        quantization=quantization,
        linear_layout=config.linear_layout,
        attention_backend=config.attention_backend,
        compile_decode=compile_decode,
        compile_cache=compile_cache,
        cuda_graphs=config.cuda_graphs and device.type == "cuda",
        max_loras=config.max_loras if config.lora_enabled else 0,
        max_lora_rank=config.max_lora_rank,
        tp=tp,
        compile_while_serving=beside_serving,
    )


def extra_kv_bytes(config: ServerConfig, dtype: torch.dtype) -> int:
    """The KV bytes the extra models keep per block of the main model's pool: each has a pool of
    as many blocks (engine/fusion.py), so one memory budget sizes them all."""
    return sum(
        KVLayout.of(text_config(Path(source)), config.block_size, dtype).bytes_per_block
        for source in config.extra_model_sources().values()
    )


def extra_weight_bytes(config: ServerConfig, dtype: torch.dtype) -> int:
    """The device bytes the extra models' weights will take in `dtype` (their tensors' element
    counts from the safetensors headers; a pickle checkpoint's file size), so that an automatic
    KV pool sized before they load leaves room for them. An int8 format takes less: room to
    spare, never too little."""
    element = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for source in config.extra_model_sources().values():
        files = sorted(Path(source).glob("*.safetensors"))
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                total += sum(prod(f.get_slice(k).get_shape()) for k in f.keys()) * element
        if not files:
            total += sum(p.stat().st_size for p in Path(source).glob("*.bin"))
    return total


def build_companions(
    config: ServerConfig, main: ModelRunner, device: torch.device
) -> dict[str, ModelRunner]:
    """The extra models, each on a KV pool of the main model's block count (its blocks' ids are
    the main pool's: engine/fusion.py), in the main model's dtype and int8 format, and beside a
    decoder-only main model with its decode step: compiled (while serving, on the CPU, as its
    is), CUDA graphs, attention backend. An encoder-decoder served model's companions run its
    rows' decoder tokens eagerly (TargetLM).
    ValueError for what cannot be fused yet: an encoder-decoder extra model, tensor
    parallelism. An automatic KV pool on a GPU left room for their weights (extra_weight_bytes)."""
    sources = config.extra_model_sources()
    if not sources:
        return {}
    if main.tp is not None:
        raise ValueError("extra_models do not run with tensor parallelism yet")
    companions: dict[str, ModelRunner] = {}
    for name, source in sources.items():
        if is_seq2seq(text_config(Path(source))):
            raise ValueError(
                f"extra model {name!r} is an encoder-decoder model: LM fusion needs a "
                "decoder-only language model"
            )
        if main.encoder_decoder:  # its rows: a source first
            companions[name] = TargetLM(Path(source), **same_pool(config, main, device))
        else:
            companions[name] = ModelRunner(
                Path(source), **same_pool(config, main, device), **same_step(config, main, source)
            )
        log.info("extra model %s loaded from %s", name, source)
    return companions


def same_pool(config: ServerConfig, main: ModelRunner, device: torch.device) -> dict[str, Any]:
    """An extra model's runner settings that match the main model's: device, dtype, KV pool."""
    return dict(
        device=device,
        dtype=main.dtype,
        block_size=main.block_size,
        num_blocks=main.num_blocks,
        quantization=main.quantization,
        linear_layout=config.linear_layout,
    )


def same_step(config: ServerConfig, main: ModelRunner, source: str) -> dict[str, Any]:
    """An extra model's decode step as the main model's: compiled when it is (in a compile
    process of its own while serving, when the main model's is), CUDA graphs, attention."""
    compiled = main.compile_decode
    beside = None
    if compiled and main.decode_step.job is not None:  # the main model compiles while serving
        alone = config.model_copy(update={"enable_lora": False})  # adapters: the main model's
        beside = BackgroundCompile(compile_spec(alone, Path(source), torch.get_num_threads()))
    return dict(
        compile_decode=compiled,
        compile_cache=(config.cache_dir or default_cache_dir()) / "compiled",
        cuda_graphs=main.graphs is not None,
        attention_backend=main.attention_backend,
        compile_while_serving=beside,
    )


def compile_spec(config: ServerConfig, model_dir: Path, threads: int) -> str:
    """What the compile process (compile_worker.py) reads: this runner's `config` on a KV pool of
    a few blocks."""
    blocks = COMPILE_POOL_BLOCKS
    pool = {"num_kv_blocks": blocks, "max_model_len": blocks * config.block_size}
    worker = config.model_copy(update={**pool, "compile_while_serving": False})
    return json.dumps(
        {"config": worker.model_dump(mode="json"), "model_dir": str(model_dir), "threads": threads}
    )


def check_seq2seq_options(config: ServerConfig, speech: bool = False) -> None:
    """ValueError naming the settings an encoder-decoder model (`speech`: Whisper) does not run
    with yet (those left at their defaults are simply off for it)."""
    asked = {
        "attention_backend triton": config.attention_backend == "triton",
        "async_scheduling on": config.async_scheduling == "on",
        "LoRA adapters": config.lora_enabled,
        "tensor_parallel_size": config.tensor_parallel_size > 1,
    }
    if speech:  # neither is tested on Whisper's parts yet
        asked["torch_compile"] = bool(config.torch_compile)
        asked[f"quantization {config.quantization}"] = config.quantization not in ("auto", "none")
    refused = [name for name, on in asked.items() if on]
    if refused:
        kind = "Whisper models" if speech else "encoder-decoder models"
        raise ValueError(
            f"{kind} do not run with {', '.join(refused)} yet: leave "
            f"{'it' if len(refused) == 1 else 'them'} unset"
        )


def set_threads(config: ServerConfig, ranks_on_this_host: int) -> None:
    """torch's intra-op threads: the config's, else the cores shared out among the ranks that
    run on this host's CPU (one rank: torch's own default)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    elif ranks_on_this_host > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_host))


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
