"""GET /v1/models: the served model, with this server's limits (a documented extension: a client
such as the playground page sizes its controls from them)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from server.api.context import ServingContext


class ServerLimits(BaseModel):
    max_n: int
    max_best_of: int
    max_num_beams: int
    max_logprobs: int
    max_stop_sequences: int
    max_prompts_per_request: int
    max_scored_prompt_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "beamline"
    root: str | None = None  # vLLM's: the model's path, or a LoRA adapter's source
    parent: str | None = None  # a LoRA adapter's base model (null for the base itself)
    max_model_len: int | None = None
    limits: ServerLimits | None = None
    # the model's sampling defaults that apply to fields a request leaves unset (empty: none)
    sampling_defaults: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def model_list(ctx: ServingContext) -> ModelList:
    """The served model, each extra model requests may name (with its own sampling defaults),
    then each LoRA adapter (by name, its `parent` the served model)."""
    cfg = ctx.config
    limits = ServerLimits(**{name: getattr(cfg, name) for name in ServerLimits.model_fields})
    base = ModelCard(
        id=ctx.model_name,
        root=cfg.model,
        max_model_len=ctx.max_model_len,
        limits=limits,
        sampling_defaults=ctx.sampling_defaults,
    )
    adapters = [
        base.model_copy(update={"id": name, "root": source, "parent": ctx.model_name})
        for name, source in sorted(ctx.engine.adapter_names().items())
    ]
    extra = [
        base.model_copy(
            update={
                "id": name,
                "root": named.source,
                "sampling_defaults": ctx.sampling_defaults_of(name),
            }
        )
        for name, named in ctx.named_models.items()
        if named.refusal is None
    ]
    return ModelList(data=[base, *extra, *adapters])
