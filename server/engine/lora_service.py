"""The engine's side of LoRA adapters: the served names (registry), the device slots the
scheduler hands out, copying a newly assigned adapter into the model's slots before a step, and
the adapters' metrics. Only the engine uses it; the scheduler sees the slots alone."""

from __future__ import annotations

from collections.abc import Iterable

from server.engine.adapters import AdapterRegistry, AdapterSlots
from server.engine.client import UnknownAdapter
from server.engine.request import EngineRequest
from server.metrics import Metrics
from server.model.lora.files import AdapterError
from server.model.lora.modules import LoRAModules
from server.step_plan import AdapterInstall


class EngineLoRA:
    def __init__(self, lora: LoRAModules, max_cpu_loras: int | None) -> None:
        self.lora = lora
        self.registry = AdapterRegistry(lora.read, max_cpu_loras or lora.num_slots)
        self.slots = AdapterSlots(lora.num_slots)
        self._published: tuple[list[str], list[str]] | None = None

    def resolve(self, request: EngineRequest, metrics: Metrics | None = None) -> str | None:
        """Give `request` its adapter's weights (counted in `metrics`); None, or why it cannot
        run (no such adapter, or its files can no longer be read)."""
        name = request.model_name
        assert name is not None
        try:
            request.adapter = self.registry.resolve(name)
        except UnknownAdapter:
            return f"LoRA adapter {name!r} is not loaded"
        except AdapterError as exc:
            return str(exc)
        if metrics is not None:
            metrics.record_lora_request(name)
        return None

    def take_installs(
        self, waiting: Iterable[EngineRequest], metrics: Metrics | None
    ) -> list[AdapterInstall]:
        """The adapters the scheduler just gave a slot, for the next plan to install; publishes
        which adapters running and `waiting` requests use when that changed."""
        installs = [AdapterInstall(slot, w.weights) for slot, w in self.slots.take_installs()]
        if metrics is not None:
            self._publish(waiting, metrics)
        return installs

    def _publish(self, waiting: Iterable[EngineRequest], metrics: Metrics) -> None:
        queued = sorted({r.model_name for r in waiting if r.model_name and r.adapter})
        state = (self.slots.running_names(), queued)
        if state != self._published:
            self._published = state
            metrics.set_lora_state(max_lora=self.slots.num_slots, running=state[0], waiting=queued)
