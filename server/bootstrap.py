"""Builds the serving stack from a ServerConfig: the model's files found before the port opens
(`prepare_model`), then, while `/health` says "loading", the engine (in a thread of this process
or in a process of its own), the tokenizer the front end uses, metrics, grammars."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from server.api.encoder_decoder import SourceModel
from server.api.fusion_models import fusion_models
from server.api.named_models import named_models
from server.api.sampling_defaults import describe, read_sampling_defaults
from server.api.serving import ServingContext
from server.audio.speech_model import SpeechModel
from server.config import ServerConfig
from server.device_defaults import with_device_defaults
from server.engine.async_engine import AsyncEngine
from server.engine.client import EngineClient
from server.loading import (
    check_tensor_parallel,
    freeze_start_up_objects,
    load_engine,
    with_extra_model_dirs,
)
from server.metrics import Metrics
from server.model.architecture import check_servable
from server.model.ct2_whisper import is_ct2_whisper
from server.model.devices import pick_device
from server.model.hub import ModelNotFound
from server.model.loader import (
    default_cache_dir,
    loading_plan,
    locate_model,
    resolve_model_dir,
    served_model_name,
)
from server.process.client import EngineProcessClient
from server.process.replicas import ReplicatedEngine
from server.tokenizer_cache import load_tokenizer, token_bytes_path

log = logging.getLogger(__name__)


def runs_engine_process(
    setting: str, device_type: str, tensor_parallel_size: int = 1, data_parallel_size: int = 1
) -> bool:
    """`engine_process` auto: on CUDA, where a step takes milliseconds and the front end's share of
    the GIL is most of a step; off on the CPU, where the second process competes with the model's
    compute threads for the same cores (docs/performance has the measurement). Always on under
    tensor parallelism (the engine process starts and supervises the other ranks) and data
    parallelism (each copy of the model is an engine process)."""
    if tensor_parallel_size > 1 or data_parallel_size > 1:
        return True
    return setting == "on" or (setting == "auto" and device_type == "cuda")


class ModelLoadFailed(RuntimeError):
    """The model's files were found but did not load: `beamline serve` ends with exit code 1."""


def prepare_model(config: ServerConfig) -> ServerConfig:
    """Before the port opens: find the model's files (downloading a hub model's), so that a
    model that cannot be found ends start-up at once (ModelNotFound, one line), and say what
    loading will do. The config returned names the local path and the id to serve it as."""
    located = locate_model(config.model, config.revision, config.allow_pickle_weights)
    log.info(
        "%s; the port opens now and /health answers 503 until the model is ready",
        loading_plan(located, config.cache_dir),
    )
    # a GGUF file or a CTranslate2 Whisper: once converted, before the engine loads
    if located.path.is_dir() and not is_ct2_whisper(located.path):
        check_servable(located.path)  # an encoder-decoder model is refused before the port opens
        check_tensor_parallel(config, located.path)
    name = config.served_model_name or located.name
    adapters = locate_adapters(config.lora_adapters(), name)
    extra = {
        n: locate_model(source, None, config.allow_pickle_weights).path
        for n, source in config.extra_model_sources().items()
    }
    if name in extra:
        raise ModelNotFound(f"extra model {name!r} has the served model's name: rename it")
    if both := sorted(set(extra) & set(adapters)):
        raise ModelNotFound(f"{both[0]!r} names an extra model and a LoRA adapter: rename one")
    return config.model_copy(
        update={
            "model": str(located.path),
            "served_model_name": name,
            "lora_modules": [f"{n}={source}" for n, source in adapters.items()],
            "extra_models": [f"{n}={path}" for n, path in extra.items()],
        }
    )


def locate_adapters(adapters: dict[str, str], model_name: str) -> dict[str, str]:
    """The start-up adapters with hub ids replaced by their local snapshots (downloaded when
    the cache lacks them); an adapter named like the model is refused: `model` picks one."""
    from server.model.hub import ModelNotFound, fetch_hub_adapter, parse_hub_id

    located = {}
    for name, source in adapters.items():
        if name == model_name:
            raise ModelNotFound(
                f"LoRA adapter {name!r} has the served model's name: a request's `model` "
                "could not choose between them (rename the adapter or set served_model_name)"
            )
        hub = parse_hub_id(source)
        local = Path(source).expanduser()
        if not local.exists() and hub is not None and hub.file is None:
            local = fetch_hub_adapter(hub.repo_id)
        located[name] = str(local)
    return located


def build_serving_context(config: ServerConfig) -> ServingContext:
    """Load everything and start the engine loop; ModelLoadFailed names the model and the cause.
    Never touches the network (prepare_model fetched what a hub model needs)."""
    try:
        return _build_serving_context(config)
    except Exception as exc:
        cause = " ".join(str(exc).split())  # one line: transformers' messages span several
        raise ModelLoadFailed(
            f"{config.model or 'the default model'}: {type(exc).__name__}: {cause}"
        ) from exc


IDLE_BEFORE_GRAMMARS_S = 1.0  # the engine idle this long: the grammar tokenizer is built then
GRAMMARS_AT_THE_LATEST_S = 60.0  # or this long after start-up, idle or not


def after_start_up(ctx: ServingContext, poll_s: float = 0.1) -> None:
    """At the first second the engine has no request (or a minute after start-up): move start-up's
    objects out of the garbage collector's reach (freeze_start_up_objects: a full collection,
    0.4-0.8 s on a 2-core CPU), then build the grammar engine's view of the tokenizer. Both hold
    the GIL for most of it (llguidance 1.4 s for Gemma's vocabulary from the bytes kept in the
    cache dir, 4.8 s at a first start), which would stall the steps of requests in flight; the
    first answer does not wait for either. A constrained request that comes first builds the
    grammar tokenizer itself (grammars.py)."""
    deadline = time.monotonic() + GRAMMARS_AT_THE_LATEST_S
    idle_since: float | None = None
    while (now := time.monotonic()) < deadline:
        try:
            stats = ctx.engine.stats()
        except Exception:  # an engine that cannot say: build it now
            break
        if stats.get("num_requests_running") or stats.get("num_requests_waiting"):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= IDLE_BEFORE_GRAMMARS_S:
            break
        time.sleep(poll_s)
    freeze_start_up_objects()
    time.sleep(poll_s)  # between two holds of the GIL: the HTTP loop answers what waited
    started = time.monotonic()
    if ctx.grammars.prepare():
        log.info("grammar tokenizer ready in %.1f s", time.monotonic() - started)


def refuse_a_pool_without_a_window(engine: EngineClient, speech: SpeechModel) -> None:
    """A speech model whose KV pool cannot hold one window's row could serve no upload: refused
    at start-up (the engine shut down) rather than leave every upload waiting."""
    kv = engine.kv_capacity
    need = kv.blocks_for(speech.window_tokens)
    if need > kv.num_blocks:
        engine.shutdown()
        raise ValueError(
            f"the KV cache holds {kv.num_blocks} blocks of {kv.block_size} positions, and one "
            f"window of this speech model needs {need} ({speech.window_tokens} positions: its "
            "audio's and the decoder's): raise num_kv_blocks (or the memory given to the cache)"
        )


def _build_serving_context(config: ServerConfig) -> ServingContext:
    started_at = time.monotonic()
    device = pick_device(config.device)
    config = with_device_defaults(config, device.type)  # a no-op when `beamline serve` did it
    name = config.served_model_name or served_model_name(config.model)
    metrics = Metrics(name, list(config.extra_model_sources()))
    started = time.monotonic()
    engine: EngineClient
    config = with_extra_model_dirs(config)  # converts a GGUF once, here
    parallel = (config.tensor_parallel_size, config.data_parallel_size)
    if runs_engine_process(config.engine_process, device.type, *parallel):
        model_dir = resolve_model_dir(config.model, config.cache_dir)  # converts a GGUF once
        check_tensor_parallel(config, model_dir)  # before a process is started for nothing
        process: EngineProcessClient | ReplicatedEngine
        if config.data_parallel_size > 1:
            if device.type != "cpu":
                raise ValueError(
                    "data_parallel_size > 1 runs on the CPU only: on GPUs, run a server per "
                    "device behind a load balancer, or use tensor_parallel_size"
                )
            process = ReplicatedEngine(config, metrics)
        else:
            process = EngineProcessClient(config, metrics)
        process.start()
        log.info("engine process %s ready in %.0f s", process.pid, time.monotonic() - started)
        tokenizer = load_tokenizer(model_dir, config.cache_dir or default_cache_dir())
        engine, vocab_size = process, process.ready.vocab_size
    else:
        loaded = load_engine(config)
        loaded.engine.use_metrics(metrics)
        in_thread = AsyncEngine(loaded.engine)
        in_thread.start(warm_up=loaded.warm_up)  # compiled and recorded where steps run
        log.info("engine ready in %.0f s", time.monotonic() - started)
        engine, tokenizer, vocab_size = in_thread, loaded.tokenizer, loaded.runner.vocab_size
        model_dir = loaded.model_dir
    ctx = ServingContext(
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        max_model_len=engine.max_model_len,
        vocab_size=vocab_size,
        config=config,
        metrics=metrics,
        model_sampling_defaults=read_sampling_defaults(model_dir),
        encoder_decoder=SourceModel.read(model_dir, tokenizer),
        speech=SpeechModel.read(model_dir, tokenizer),
        grammar_token_bytes=token_bytes_path(model_dir, config.cache_dir or default_cache_dir()),
        fusion_models=fusion_models(config, model_dir, tokenizer),
    )
    decoder_only = ctx.encoder_decoder is None and ctx.speech is None
    ctx.named_models = named_models(
        config, ctx.fusion_models, decoder_only, ctx.engine.eos_token_ids, tokenizer
    )
    if ctx.speech is not None:
        refuse_a_pool_without_a_window(ctx.engine, ctx.speech)
    if ctx.encoder_decoder is not None:  # generate()'s defaults too; greedy unless it samples
        ctx.model_sampling_defaults.update(ctx.encoder_decoder.defaults)
    log.info(describe(ctx.model_sampling_defaults, config.generation_config_defaults))
    if ctx.encoder_decoder is not None and ctx.encoder_decoder.not_applied:
        listed = ", ".join(f"{k} {v}" for k, v in ctx.encoder_decoder.not_applied.items())
        log.warning(
            "the model's generation_config.json sets %s, which generate() applies and beamline "
            "does not yet for encoder-decoder models: set the decoding fields in requests",
            listed,
        )
    log.info(
        "ready: serving %s on http://%s:%d, loaded in %.0f s from %s (max_model_len %s)",
        name,
        config.host,
        config.port,
        time.monotonic() - started_at,
        model_dir,
        f"{engine.max_model_len:,}",
    )
    later = threading.Thread(target=after_start_up, args=(ctx,), name="beamline-after-start")
    later.daemon = True
    later.start()
    return ctx
