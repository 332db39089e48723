"""The LoRA adapters' settings (a group of ServerConfig's keys)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def comma_list(v: Any) -> Any:
    """Env vars give lists as comma-separated strings."""
    return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v


def named_sources(entries: list[str], key: str, what: str) -> dict[str, str]:
    """`key`'s NAME=SOURCE entries as {name: source}; ValueError unless each is one and names
    one `what` once."""
    pairs = [tuple(p.strip() for p in e.split("=", 1)) for e in entries]
    if not all(len(p) == 2 and all(p) for p in pairs):
        raise ValueError(f"{key} entries are NAME=SOURCE, got {entries}")
    if len({p[0] for p in pairs}) != len(pairs):
        raise ValueError(f"{key} names each {what} once, got {entries}")
    return dict(pairs)  # type: ignore[arg-type]  # pairs, checked above


class LoRASettings(BaseModel):
    """The LoRA adapters' settings (a group of ServerConfig's keys)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapter served from start-up, NAME=SOURCE: peft's files in a directory "
        "or a hub id (resolved like --model); a request picks it by its `model`",
    )
    enable_lora: bool | None = Field(
        None,
        description="serve LoRA adapters (steps with an adapter row run eagerly); empty = on when "
        "lora_modules are given or allow_runtime_lora_updating is on",
    )
    max_loras: int = Field(4, ge=1, description="adapters resident on the device at once")
    max_lora_rank: int = Field(16, ge=1, le=512, description="largest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters' weights kept in host memory (LRU); empty = max_loras"
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)",
    )

    _adapter_list = field_validator("lora_modules", mode="before")(comma_list)

    @model_validator(mode="after")
    def _lora_settings(self) -> LoRASettings:
        self.lora_adapters()  # NAME=SOURCE, each name once
        if self.lora_modules and self.enable_lora is False:
            raise ValueError("lora_modules are given but enable_lora is false")
        if (self.max_cpu_loras or self.max_loras) < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras")
        return self

    def lora_adapters(self) -> dict[str, str]:
        """`lora_modules` as {name: source}."""
        return named_sources(self.lora_modules, "lora_modules", "adapter")

    @property
    def lora_enabled(self) -> bool:
        if self.enable_lora is not None:
            return self.enable_lora
        return bool(self.lora_modules) or self.allow_runtime_lora_updating
