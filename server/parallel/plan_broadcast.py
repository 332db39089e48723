"""How a step reaches the other ranks of a tensor-parallel group: the driver (rank 0) broadcasts
the plan it hands its own model runner, in the plan's one encoding (step_plan.encode_plan), and
every other rank decodes it and runs the same `ModelRunner.execute`, so every rank applies the
same table edits and adapter installs, packs the same step and meets the driver at every
collective of the forward (as vLLM's workers apply the scheduler's output).

Each message is a header (op, int payload length, float payload length, deferred tokens), the
int32 payload, then the installs' weights as one float tensor and async scheduling's deferred
tokens as the device tensor they are, when there are any.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from server.parallel.group import TPGroup
from server.step_plan import StepOutput, StepPlan, decode_plan, encode_plan

STEP, STOP = 1, 2
HEADER = 4  # op, payload length, float payload length, deferred tokens


class StepBroadcast:
    """The driver's side: each plan, and the end, sent to every other rank."""

    def __init__(self, group: TPGroup, adapter_paths: list[str]) -> None:
        self.group = group
        self.adapter_paths = adapter_paths

    @classmethod
    def of_driver(cls, group: TPGroup | None, adapter_paths: list[str]) -> StepBroadcast | None:
        """The driver's broadcast (None on one rank, or on a follower); `adapter_paths`: the
        projections LoRA adapters may change, in the order installs send them."""
        if group is None or not group.is_driver:
            return None
        return cls(group, adapter_paths)

    def _send(self, op: int, payload: list[int], floats: int = 0, deferred: int = 0) -> None:
        header = torch.tensor([op, len(payload), floats, deferred], dtype=torch.long)
        self.group.broadcast(header)
        if payload:
            self.group.broadcast(torch.tensor(payload, dtype=torch.int32))

    def step(self, plan: StepPlan) -> None:
        data, floats = encode_plan(plan, self.adapter_paths)
        deferred = plan.deferred
        values = 0 if deferred is None else len(deferred.values)
        self._send(STEP, data, floats=-1 if floats is None else len(floats), deferred=values)
        if floats is not None and len(floats):
            self.group.broadcast(floats)
        if deferred is not None:
            self.group.broadcast(deferred.values)

    def stop(self) -> None:
        self._send(STOP, [])


class StepFollower:
    """A follower rank's loop: run what the driver broadcasts until it says stop (`execute`: its
    model runner's; `adapter_shapes`: each adaptable projection's (in, out), if LoRA is on)."""

    def __init__(
        self,
        group: TPGroup,
        execute: Callable[[StepPlan], StepOutput],
        adapter_shapes: dict[str, tuple[int, int]],
    ) -> None:
        self.group = group
        self.execute = execute
        self.adapter_shapes = adapter_shapes

    def run(self) -> None:
        while True:
            op, length, floats, deferred = self.group.broadcast(
                torch.empty(HEADER, dtype=torch.long)
            ).tolist()
            payload = (
                self.group.broadcast(torch.empty(length, dtype=torch.int32)).tolist()
                if length
                else []
            )
            if op == STOP:
                return
            weights = None
            if floats >= 0:
                weights = self.group.broadcast(torch.empty(floats)) if floats else torch.empty(0)
            values = None
            if deferred:
                buffer = torch.empty(deferred, dtype=torch.long, device=self.group.device)
                values = self.group.broadcast(buffer)
            self.execute(decode_plan(payload, weights, values, self.adapter_shapes))
