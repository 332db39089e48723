"""The tensor-parallel settings (a group of ServerConfig's keys)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="split the model across this many devices (CUDA: cuda:0..N-1 over NCCL; "
        "the CPU: N processes over gloo), a rank each, started by the engine process (which "
        "is then always on); decode steps run eagerly; 1 = one device",
    )

    @model_validator(mode="after")
    def _ranks_need_the_engine_process(self) -> ParallelSettings:
        if self.tensor_parallel_size > 1 and getattr(self, "engine_process", "auto") == "off":
            raise ValueError(
                "tensor_parallel_size > 1 runs the engine in a process of its own (it starts "
                "and supervises the other ranks): engine_process cannot be off"
            )
        return self
