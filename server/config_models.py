"""The extra models' setting (a group of ServerConfig's keys): models served beside the main one."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.config_lora import comma_list, named_sources


class ExtraModelSettings(BaseModel):
    """Models loaded beside the main one (a group of ServerConfig's keys)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    extra_models: list[str] = Field(
        default_factory=list,
        description="another model loaded beside the main one, NAME=SOURCE (a directory, .gguf "
        "file or hub id, resolved like --model): a decoder-only language model that requests "
        "name as their `model` (when it reads text as the main model does: the same vocabulary "
        "and end-of-sequence ids) or fuse into their steps with lm_fusion (the same vocabulary); "
        "its KV cache has as many blocks as the main model's, within the same memory budget",
    )

    speculative_model: str | None = Field(
        None,
        description="speculation with a draft model: the name of one of extra_models (sharing the "
        "main model's vocabulary) that drafts up to num_speculative_tokens tokens per decoding row "
        "per step, in place of n-gram drafts; the main model verifies them as it verifies n-gram "
        "drafts (greedy and seeded output unchanged); unset = n-gram drafts",
    )

    _model_list = field_validator("extra_models", mode="before")(comma_list)

    @model_validator(mode="after")
    def _extra_model_settings(self) -> ExtraModelSettings:
        names = self.extra_model_sources()  # NAME=SOURCE, each name once
        if self.speculative_model is not None and self.speculative_model not in names:
            raise ValueError(
                f"speculative_model {self.speculative_model!r} is not one of extra_models "
                f"({', '.join(names) or 'none set'})"
            )
        return self

    def extra_model_sources(self) -> dict[str, str]:
        """`extra_models` as {name: source}."""
        return named_sources(self.extra_models, "extra_models", "model")
