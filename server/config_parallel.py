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
        "is then always on); torch_compile compiles each rank's decode step with its "
        "collectives, CUDA graphs stay off; 1 = one device",
    )

    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="serve this many copies of the model, each an engine process with its own "
        "KV pool and an equal share of the cores (torch threads) and of the KV pool settings "
        "(kv_cache_memory or num_kv_blocks are the server's total); each request runs whole in "
        "the copy with the fewest rows in flight. For small models on the CPU, where one "
        "engine's threads scale poorly (CTranslate2's inter_threads); CPU only, not with "
        "tensor_parallel_size; 1 = one engine",
    )

    nnodes: int = Field(
        1,
        ge=1,
        description="nodes the tensor_parallel_size ranks are spread over, evenly; every node "
        "runs the same command with its node_rank, and they meet at MASTER_ADDR:MASTER_PORT "
        "(node 0's address and a free port of it)",
    )
    node_rank: int = Field(
        0,
        ge=0,
        description="this node's index among nnodes: 0 serves HTTP and holds rank 0; the others "
        "run their ranks headless (no port)",
    )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @model_validator(mode="after")
    def _ranks_fit_the_nodes(self) -> ParallelSettings:
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must divide evenly over "
                f"nnodes ({self.nnodes})"
            )
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel_size and tensor_parallel_size cannot both be above 1: copies of a "
                "model split over ranks are not built; choose one"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be < nnodes ({self.nnodes})")
        return self
