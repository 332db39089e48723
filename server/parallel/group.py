"""A tensor-parallel group: this process's rank among the processes that each hold a shard of the
model, and the few collectives the model side needs, over `torch.distributed` (NCCL on CUDA,
gloo on the CPU). Rank 0 is the driver: it schedules, samples and talks to the front end; every
rank runs the same forward on its shard (shard.py) and the steps reach the others as tensors
(plan_broadcast.py)."""

from __future__ import annotations

import logging
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger(__name__)
DRIVER = 0
# How long a collective may wait for a peer before it fails: start-up (every rank loading its
# shard) is the longest wait; a dead peer is noticed by the supervisor (workers.py) sooner.
COLLECTIVE_TIMEOUT = timedelta(minutes=20)


# Ports a rendezvous takes: the 12,000 below the OS's ephemeral range, where no outgoing connection
# takes its port. A port found free is bound only seconds later (when the driver has started its
# ranks); one from the ephemeral range could be taken by any connection in between (seen in the
# tests: EADDRINUSE).
RENDEZVOUS_PORTS = 12_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port nothing on this host listens on now, below the ephemeral range where one is free
    there (any free port else)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    candidates = range(max(1024, low - RENDEZVOUS_PORTS), low)
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: torch.distributed's standard MASTER_ADDR and MASTER_PORT (the
    driver's host and a free port of it, for ranks on one node)."""

    address: str
    port: int

    @classmethod
    def from_env(cls, required: bool = False) -> Rendezvous:
        """From MASTER_ADDR and MASTER_PORT; on one node they may be left out (this host and a
        free port), across nodes (`required`) both must name node 0's."""
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if required and not (address and port):
            raise ValueError(
                "ranks on several nodes meet at MASTER_ADDR:MASTER_PORT (node 0's address and a "
                "free port of it): set both, the same on every node"
            )
        return cls(address or "127.0.0.1", int(port) if port else free_port())

    @property
    def url(self) -> str:
        return f"tcp://{self.address}:{self.port}"


def rank_device(device: torch.device, rank: int, local_ranks: int) -> torch.device:
    """The device of `rank`: cuda:(rank mod ranks per node) on CUDA; the CPU for every rank."""
    return torch.device("cuda", rank % local_ranks) if device.type == "cuda" else device


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    @property
    def wire(self) -> torch.device:
        """Where collectives' tensors live: NCCL moves device memory only, gloo host memory."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    @classmethod
    def join(cls, rendezvous: Rendezvous, rank: int, size: int, device: torch.device) -> TPGroup:
        """Join the group (blocks until every rank has); the process's default group."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=rendezvous.url,
            rank=rank,
            world_size=size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        log.info("tensor parallel: rank %d of %d on %s", rank, size, device)
        return cls(rank, size, device)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (the row-parallel layers' partial outputs).
        Inside the compiled decode step dynamo traces this call as torch's functional all-reduce
        (a graph op with its wait), so the sums are part of each rank's compiled graph."""
        dist.all_reduce(tensor)
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: each rank sizes its own pool)."""
        t = torch.tensor([value], dtype=torch.long, device=self.wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The driver's `tensor` on every rank (the others pass a buffer of its shape and
        dtype); host tensors travel through the device under NCCL."""
        on_wire = tensor.to(self.wire)
        dist.broadcast(on_wire, src=DRIVER)
        return on_wire.to(tensor.device) if on_wire is not tensor else tensor

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The driver's full logits [R, vocab] from every rank's vocabulary shard [R, <= shard]
        (the last shard may be narrower: padded with -inf, cut after); other ranks get [0,
        vocab]: only the driver samples."""
        shard = -(-vocab_size // self.size)
        if local.shape[1] < shard:
            local = F.pad(local, (0, shard - local.shape[1]), value=float("-inf"))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_driver else None
        dist.gather(local, parts, dst=DRIVER)
        if parts is None:
            return local.new_empty((0, vocab_size))
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of the vocabulary this rank's embedding and LM head hold."""
        shard = -(-vocab_size // self.size)
        start = min(self.rank * shard, vocab_size)
        return start, min(start + shard, vocab_size)
