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
from transformers import PreTrainedTokenizerBase

from server.config import ServerConfig
from server.device_defaults import with_device_defaults
from server.engine.draft_model import DraftModel
from server.engine.engine import Engine
from server.engine.fusion import Companions
from server.model.architecture import source_and_target_positions
from server.model.devices import pick_device
from server.model.loader import default_cache_dir, resolve_model_dir
from server.model.runner import ModelRunner, eos_token_ids
from server.model.weights import text_config
from server.parallel.group import Rendezvous, TPGroup, rank_device
from server.parallel.shard import check_tp_size
from server.parallel.workers import TPWorkers
from server.runner_setup import build_companions, build_runner, set_threads
from server.tokenizer_cache import load_tokenizer

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


@dataclass
class LoadedEngine:
    engine: Engine
    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    config: ServerConfig  # with the device's defaults applied
    workers: TPWorkers | None = None  # the follower ranks, under tensor parallelism

    def warm_up(self) -> None:
        """Before serving, in the thread that steps: the served model's decode step, then each
        extra model's (compiled or started compiling, graphs captured: ModelRunner.warm_up)."""
        self.runner.warm_up()
        for extra in self.engine.companions.runners.values():
            extra.warm_up()

    def close(self) -> None:
        """Stop the follower ranks, if any (after the engine's last step)."""
        if self.runner.tp_steps is None or self.workers is None:
            return
        try:
            self.runner.tp_steps.stop()
        except Exception:  # a rank already gone: its supervisor has ended this process or will
            log.warning("the other tensor-parallel ranks could not be told to stop", exc_info=True)
        self.workers.join()
        self.runner.tp_steps.group.leave()


def load_engine(config: ServerConfig) -> LoadedEngine:
    """Load weights, size the KV pool and build the engine (not started, no metrics yet). Never
    touches the network: a hub model's files were fetched before the port opened
    (bootstrap.prepare_model), and from here on everything loads from local paths, in this process
    and in an engine process (which inherits the variable)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(config.model, config.cache_dir)
    config = with_extra_model_dirs(config)
    device = pick_device(config.device)
    config = with_device_defaults(config, device.type)  # a no-op when `beamline serve` did it
    on_cpu = config.ranks_per_node * config.data_parallel_size if device.type == "cpu" else 1
    set_threads(config, on_cpu)
    log.info("torch intra-op threads: %d", torch.get_num_threads())
    workers, group = start_tensor_parallel(config, device)
    device = group.device if group else device
    runner = build_runner(config, model_dir, device, group)
    companions = build_companions(config, runner, device)
    tokenizer = load_tokenizer(model_dir, config.cache_dir or default_cache_dir())
    max_model_len = config.max_model_len
    if companions and runner.encoder_decoder:  # they read the decoder's tokens alone
        check_target_lm_positions(runner, companions)
    elif companions:  # a fused row runs through them too: within every model's context
        lengths = [r.max_position_embeddings for r in (runner, *companions.values())]
        max_model_len = min(max_model_len or min(lengths), min(lengths))
    engine = Engine(
        runner,
        tokenizer,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        overlap_outputs=overlaps_outputs(config.overlap_outputs, device.type),
        # an encoder-decoder step covers sources the plan names: nothing runs ahead of it
        async_scheduling=schedules_async(config.async_scheduling, device.type)
        and not runner.encoder_decoder,
        speculative_tokens=config.num_speculative_tokens,
        max_cpu_loras=config.max_cpu_loras,
        companions=Companions(
            companions,
            runner.vocab_size,
            draft=draft_model(config, runner, companions, max_model_len),
            served=serving_refusals(runner, companions, tokenizer),
        ),
    )
    for (
        name,
        source,
    ) in config.lora_adapters().items():  # lora.files.AdapterError says what is wrong
        engine.load_adapter(name, source)
    return LoadedEngine(engine, runner, tokenizer, model_dir, config, workers)


def serving_refusals(
    runner: ModelRunner, companions: dict[str, ModelRunner], tokenizer: PreTrainedTokenizerBase
) -> dict[str, str | None]:
    """Each extra model and why a request's `model` cannot name it (None: it can). It runs such
    a request's rows in the served model's batch, with its tokenizer, its grammars and its
    end-of-sequence ids: a decoder-only model beside a decoder-only one, with the same vocabulary
    and the same ids ending a sequence (the API checks the tokenizers: api/named_models.py)."""
    eos = eos_token_ids(runner.model, tokenizer)
    refusals: dict[str, str | None] = {}
    for name, extra in companions.items():
        theirs = eos_token_ids(extra.model, tokenizer)
        if runner.encoder_decoder:
            refusals[name] = "the served model is an encoder-decoder model"
        elif extra.vocab_size != runner.vocab_size:
            refusals[name] = (
                f"it scores {extra.vocab_size} tokens and the served model {runner.vocab_size}"
            )
        elif theirs != eos:
            refusals[name] = (
                f"its sequences end at token ids {sorted(theirs)}, the served model's at "
                f"{sorted(eos)}"
            )
        else:
            refusals[name] = None
    return refusals


def check_target_lm_positions(runner: ModelRunner, companions: dict[str, ModelRunner]) -> None:
    """ValueError for an extra model of an encoder-decoder served model with fewer positions
    than its decoder: a fused row's decoder tokens, all of them, run through it."""
    target = source_and_target_positions(runner.config)[1]
    for name, companion in companions.items():
        if companion.max_position_embeddings < target:
            raise ValueError(
                f"extra model {name!r} has {companion.max_position_embeddings} positions and the "
                f"served model's decoder {target}: fused rows could outgrow it"
            )


def draft_model(
    config: ServerConfig,
    runner: ModelRunner,
    companions: dict[str, ModelRunner],
    max_model_len: int | None,
) -> DraftModel | None:
    """The extra model that drafts for speculation (`speculative_model`), or None; ValueError
    when it cannot draft for this model."""
    name = config.speculative_model
    if name is None:
        return None
    draft = companions[name]
    if runner.encoder_decoder:
        raise ValueError("speculative_model does not run with an encoder-decoder model yet")
    if config.num_speculative_tokens == 0:
        raise ValueError("speculative_model drafts num_speculative_tokens tokens: it is 0")
    if draft.vocab_size != runner.vocab_size:
        raise ValueError(
            f"speculative_model {name!r} scores {draft.vocab_size} tokens and the served model "
            f"{runner.vocab_size}: a draft model must share its vocabulary"
        )
    log.info("speculation: %s drafts up to %d tokens", name, config.num_speculative_tokens)
    limit = max_model_len or draft.max_position_embeddings  # within every model's (load_engine)
    return DraftModel(name, draft, config.num_speculative_tokens, limit)


def with_extra_model_dirs(config: ServerConfig) -> ServerConfig:
    """`config` with each extra model's source a local directory (a GGUF file converted once)."""
    sources = config.extra_model_sources()
    dirs = {name: resolve_model_dir(source, config.cache_dir) for name, source in sources.items()}
    return config.model_copy(update={"extra_models": [f"{n}={d}" for n, d in dirs.items()]})


def start_tensor_parallel(
    config: ServerConfig, device: torch.device
) -> tuple[TPWorkers | None, TPGroup | None]:
    """Under tensor parallelism: start the follower ranks and join their group as the driver."""
    size = config.tensor_parallel_size
    if size == 1:
        return None, None
    check_tensor_parallel(config, resolve_model_dir(config.model, config.cache_dir))
    rendezvous = Rendezvous.from_env(required=config.nnodes > 1)
    workers = TPWorkers(config, range(1, config.ranks_per_node), size, rendezvous)
    workers.start()
    log.info(
        "tensor parallel: %d ranks meet at %s (followers: pids %s)",
        size,
        rendezvous.url,
        workers.pids,
    )
    return workers, TPGroup.join(rendezvous, 0, size, rank_device(device, 0, size))


def check_tensor_parallel(config: ServerConfig, model_dir: Path) -> None:
    """parallel.shard.TPConfigError unless the config's ranks can split the model in `model_dir` on
    this node (its heads and MLP, its GPUs): a config.json read, nothing loaded."""
    if config.tensor_parallel_size > 1:
        device = pick_device(config.device)
        size, here = config.tensor_parallel_size, config.ranks_per_node
        check_tp_size(text_config(model_dir), size, device, here)


def freeze_start_up_objects() -> None:
    """Start-up leaves ~400k long-lived objects (torch, transformers, the tokenizer); a full
    collection walks all of them, which stalled decode steps by 10-100 ms now and then
    (benchmarks/engine_overhead.py: mean host time 12.3 ms -> 5.8 at 256 rows). Freezing moves
    them out of the collector's generations, as vLLM does after start-up."""
    gc.collect()
    gc.freeze()
