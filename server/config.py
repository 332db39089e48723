"""Server configuration: YAML file (configs/*.yaml) < BEAMLINE_<KEY> env vars < CLI flags.

A wrong key or value stops start-up with a message naming it (pydantic, extra keys forbidden).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from server.config_lora import LoRASettings, comma_list
from server.config_models import ExtraModelSettings
from server.config_parallel import ParallelSettings
from server.model.devices import DType, Quantization
from server.sizes import ByteSize, KVSize


class ServerConfig(ExtraModelSettings, LoRASettings, ParallelSettings):
    """Every setting of the server; each `description` is also its `beamline serve --help` text."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=1, le=65535, description="port")
    model: str | None = Field(
        None,
        description="Hugging Face hub id (org/name; org/name:QUANT picks a .gguf file of a GGUF "
        "repo), local model directory or .gguf file; empty = default (Gemma 3 270M)",
    )
    revision: str | None = Field(
        None, description="branch, tag or commit of a hub model id; empty = main"
    )
    allow_pickle_weights: bool = Field(
        False,
        description="download and load PyTorch .bin (pickle) weights of a hub repo that has no "
        "safetensors; off: such a repo is refused",
    )
    served_model_name: str | None = Field(None, description="model id reported by the API")
    cache_dir: Path | None = Field(
        None,
        description="where converted GGUF models, compiled steps, tokenizers and int8 weights live",
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: DType = Field("auto", description="auto = bfloat16 on CUDA, float32 on the CPU")
    quantization: Quantization = Field(
        "auto",
        description="CPU only. int8: int8 LM head; int8-weights: also weight-only int8 decoder "
        "layers; w8a8: int8 LM head, decoder layers as int8 x int8 GEMMs (per-token and measured "
        "input scales), down_proj weight-only; w8a8-all: every decoder (and encoder) layer an "
        "int8 GEMM (CTranslate2's int8: faster, less accurate); every int8 head re-scores each "
        "row's top candidates exactly; auto = w8a8 on a CPU with int8 dot-product instructions "
        "(VNNI, AMX) when dtype is auto, else none (--dtype float32 is the exact mode); "
        "encoder-decoder models: none under auto, an int8 format only when named",
    )
    linear_layout: Literal["auto", "onednn", "measured", "transposed", "native"] = Field(
        "auto",
        description="CPU linear layers: onednn (weights prepacked for oneDNN: one pass over the "
        "weight per call at any batch size), measured (the decoder transposed, the LM head in "
        "both layouts, each call using the one timed faster at start-up for its row count), "
        "transposed (weights stored [in, out]) or native (as loaded); auto = onednn where it is "
        "timed faster than the better plain layout at start-up (not with torch_compile), else "
        "measured; native on CUDA",
    )
    attention_backend: Literal["auto", "gather", "triton"] = Field(
        "auto",
        description="paged attention: triton reads keys and values through the block table in "
        "one kernel per layer (CUDA); gather copies each row's history out of the pool, then "
        "SDPA (the reference, and the CPU's path); auto = triton on CUDA, gather on the CPU",
    )
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads of a model step (torch intra-op); empty = one per core"
    )
    torch_compile: bool | None = Field(
        None,
        description="torch.compile the decode step, compiled at a first start (minutes on a small "
        "CPU) and loaded from the cache dir at later starts; empty = on where quantization auto "
        "chose w8a8 (the CPU default) and a C++ compiler is on PATH, else off (and always off "
        "for an encoder-decoder model unless set)",
    )
    compile_while_serving: bool = Field(
        True,
        description="with torch_compile on the CPU (not under tensor parallelism): answer at once "
        "with the eager decode step while a process compiles it (or a thread reads it from the "
        "cache), then switch between two steps; off: compile or load it before /health is 200",
    )
    cuda_graphs: bool = Field(
        True,
        description="on CUDA with the triton attention backend: decode steps replay CUDA graphs "
        "captured at start-up for 1, 2, 4 ... max_num_seqs rows (their memory is reserved from "
        "the KV budget)",
    )
    overlap_outputs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="render a step's text (detokenize, stop strings, stream) while the device "
        "runs the next step; auto = on on CUDA, off on the CPU (its forward blocks the host)",
    )
    async_scheduling: Literal["auto", "on", "off"] = Field(
        "auto",
        description="plan and queue the next step before reading this step's tokens back, so the "
        "host's work runs while the device computes (outputs unchanged; a row a finishing token "
        "or stop string ends computes one token more, dropped; steps with beam searches or "
        "drafts read at once, so rows do not draft while steps overlap); auto = on on CUDA, off "
        "on the CPU (its forward blocks the host)",
    )
    num_speculative_tokens: int = Field(
        8,
        ge=0,
        le=16,
        description="speculation: a decoding row drafts up to this many tokens (from where its "
        "last n-gram occurred before in its prompt or output, or from speculative_model) and one "
        "forward verifies them (greedy and seeded output unchanged); the count adapts per row "
        "and a row whose drafts are rejected stops drafting for a while; 0 = off",
    )
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="step the engine in a process of its own (its own GIL: the HTTP front end "
        "no longer takes the engine's steps) instead of a thread of the server's process; "
        "auto = on on CUDA, off on the CPU (see docs/guides/tuning.md)",
    )
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache block")
    kv_cache_memory: KVSize = Field(
        "auto",
        description="KV pool size, e.g. 8GiB, or auto: on CUDA, gpu_memory_utilization x device "
        "memory less the weights and the peak of a worst-case step (measured at start-up); on "
        "the CPU 1GiB (host RAM is shared with everything else: set a size to use more)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="share of the GPU's memory this server may fill (weights, activations, KV "
        "pool); only used by kv_cache_memory auto on CUDA",
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV pool size in blocks (overrides kv_cache_memory)"
    )
    max_num_seqs: int = Field(
        64, ge=1, description="sequences running at once (256 on CUDA unless set)"
    )
    max_num_batched_tokens: int = Field(
        512, ge=1, description="token budget of one engine step (2048 on CUDA unless set)"
    )
    max_model_len: int | None = Field(None, ge=1, description="context length cap")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of prompt prefixes seen before"
    )
    max_n: int = Field(16, ge=1, description="largest n (choices) a request may ask for")
    max_best_of: int = Field(16, ge=1, description="largest best_of a request may ask for")
    max_num_beams: int = Field(16, ge=1, description="largest num_beams a request may ask for")
    max_logprobs: int = Field(20, ge=0, description="most top logprobs a request may ask for")
    max_scored_prompt_tokens: int = Field(
        8192,
        ge=0,
        description="longest prompt that prompt logprobs (echo + logprobs, prompt_logprobs) may "
        "score: the LM head runs on every prompt position",
    )
    max_stop_sequences: int = Field(16, ge=0, description="most stop strings per request")
    default_max_tokens: int = Field(
        4096,
        ge=0,
        description="max_tokens of a chat request that sets none (max_completion_tokens too), "
        "within the rest of the context; 0 = the rest of the context. Completions keep OpenAI's "
        "16",
    )
    max_tokens_limit: int = Field(
        0,
        ge=0,
        description="largest max_tokens (or max_completion_tokens) a request may ask for, 400 "
        "beyond; 0 = no limit but the context",
    )
    generation_config_defaults: bool = Field(
        True,
        description="apply the sampling defaults of the model's generation_config.json "
        "(temperature, top_p, top_k, repetition_penalty, min_p) to the fields a request leaves "
        "unset, as vLLM's --generation-config auto does; off: the API's own defaults (vLLM's "
        "--generation-config vllm)",
    )
    max_prompts_per_request: int = Field(16, ge=1, description="most prompts per completion")
    max_grammar_bytes: int = Field(
        256 * 1024, ge=1, description="largest schema / regex / grammar a request may send"
    )
    grammar_cache_size: int = Field(
        256, ge=0, description="compiled grammars kept for reuse (0 = compile every time)"
    )
    grammar_compile_timeout: float = Field(
        10.0, gt=0, description="seconds a grammar may take to compile; then 400"
    )
    playground: bool = Field(
        True, description="serve the decoding playground page at / (false: / answers 404)"
    )
    responses_store_size: int = Field(
        100,
        ge=0,
        description="responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest dropped first (0 = none: previous_response_id is a 400)",
    )
    max_waiting_requests: int = Field(
        256, ge=0, description="queued requests beyond running; then 503"
    )
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds in-flight requests get on SIGTERM"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="require this Bearer key (env BEAMLINE_API_KEYS=a,b); empty = no auth",
    )
    api_key_file: Path | None = Field(None, description="file with one API key per line")
    public_paths: list[str] = Field(
        default_factory=lambda: ["/health", "/ready", "/metrics"],
        description="path served without a key",
    )
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="enable CORS for this origin; empty = CORS off"
    )
    max_body_bytes: ByteSize = Field(4 * 1024**2, gt=0, description="body limit (413 beyond)")
    max_header_bytes: int = Field(16 * 1024, ge=1024, description="request header limit")
    max_audio_bytes: ByteSize = Field(25 * 1024**2, gt=0, description="upload limit (413 beyond)")
    max_audio_seconds: float = Field(3600, gt=0, description="longest audio decoded (400 beyond)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field("text", description="log line format")

    _lists = field_validator("api_keys", "public_paths", "cors_allow_origins", mode="before")(
        comma_list
    )

    @model_validator(mode="after")
    def _budget_fits_the_widest_request(self) -> ServerConfig:
        # All rows of a request sample in the same step, so one step must hold the widest request.
        widest = max(self.max_n, self.max_best_of, self.max_num_beams)
        if self.max_num_batched_tokens < widest:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= the "
                f"widest request allowed ({widest}: max_n / max_best_of / max_num_beams)"
            )
        return self

    @model_validator(mode="after")
    def _ranks_need_the_engine_process(self) -> ServerConfig:
        if self.tensor_parallel_size > 1 and self.engine_process == "off":
            raise ValueError(
                "tensor_parallel_size > 1 runs the engine in a process of its own (it starts "
                "and supervises the other ranks): engine_process cannot be off"
            )
        if self.data_parallel_size > 1 and self.engine_process == "off":
            raise ValueError(
                "data_parallel_size > 1 runs each copy of the model in an engine process of its "
                "own: engine_process cannot be off"
            )
        return self

    @model_validator(mode="after")
    def _default_max_tokens_within_the_limit(self) -> ServerConfig:
        if 0 < self.max_tokens_limit < self.default_max_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) must be <= max_tokens_limit "
                f"({self.max_tokens_limit}) when both are set"
            )
        return self

    def all_api_keys(self) -> list[str]:
        keys = list(self.api_keys)
        if self.api_key_file is not None:
            keys += [
                line.strip() for line in self.api_key_file.read_text().splitlines() if line.strip()
            ]
        return keys


class ConfigError(ValueError):
    pass


ENV_PREFIX = "BEAMLINE_"


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """BEAMLINE_<KEY>=value for every config key (BEAMLINE_CACHE_DIR is also the cache default)."""
    return {
        k: environ[ENV_PREFIX + k.upper()]
        for k in ServerConfig.model_fields
        if ENV_PREFIX + k.upper() in environ
    }


def load_config(
    path: Path | None, overrides: dict[str, Any], environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Read `path` (YAML mapping), then env vars, then non-None `overrides`; errors name the key."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values")
        data.update(loaded)
    data.update(env_overrides(os.environ if environ is None else environ))
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServerConfig(**data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from exc
