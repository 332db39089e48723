"""LoRA adapters as the engine sees them: which names are served (`AdapterRegistry`), and which
adapters occupy the model's device slots while their requests run (`AdapterSlots`).

A served name maps to its files; its weights are kept in host memory for at most `max_cpu_loras`
adapters (least recently used first out, read again from disk when asked for). Each load gets a
new serial, so a name unloaded and loaded again with other weights never shares prefix-cache
blocks with its former self (the prefix cache keys blocks by `ResolvedAdapter.key`).

The slots are the scheduler's to hand out: a request joins the batch only when its adapter is
resident or a slot can take it (a free one, or the least recently used one no running request
holds); a request whose adapter must wait is passed over, the others behind it may join. The
weights of a newly assigned slot are copied in by the engine before the step runs
(`take_installs`). Nothing here touches tensors: the model side does (model/lora.py and
model/lora/files.py).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable

from server.engine.client import UnknownAdapter
from server.engine.request import AdapterWeights, EngineRequest, ResolvedAdapter
from server.step_plan import NO_ADAPTER


class AdapterRegistry:
    """Served adapter names, their files, and a bounded host-memory cache of their weights.
    Thread-safe: the front end loads and unloads while the engine thread reads."""

    def __init__(
        self,
        read: Callable[[str, str], AdapterWeights],
        max_cpu_loras: int,
    ) -> None:
        # reads and checks an adapter's files, by name and source (a directory or a hub id);
        # raises the model side's AdapterError when they do not fit the model
        self._read = read
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, str]] = {}  # name -> (source, key)
        self._retired: dict[str, tuple[str, str]] = {}  # removed, until `forget`
        self._cached: OrderedDict[str, AdapterWeights] = OrderedDict()  # by key, LRU first
        self._serials = itertools.count(1)

    def add(self, name: str, source: str) -> AdapterWeights:
        """Read, check and serve `source` as `name` (ValueError when the name is taken; the
        reader's AdapterError when the files do not fit the model)."""
        with self._lock:
            if name in self._entries:
                raise ValueError(f"an adapter named {name!r} is already loaded")
        weights = self._read(name, source)  # outside the lock: may take a while
        with self._lock:
            if name in self._entries:
                raise ValueError(f"an adapter named {name!r} is already loaded")
            key = f"{name}#{next(self._serials)}"
            self._entries[name] = (source, key)
            self._remember(key, weights)
        return weights

    def remove(self, name: str) -> str:
        """Stop serving `name` (UnknownAdapter if it is not served) and return its key. Requests
        submitted before still find it until `forget(key)`; the name is free for a new load."""
        with self._lock:
            if name not in self._entries:
                raise UnknownAdapter(name)
            entry = self._entries.pop(name)
            self._retired[name] = entry
            return entry[1]

    def forget(self, key: str) -> None:
        """Drop a removed adapter for good: every request submitted before its removal has it."""
        with self._lock:
            for name, (_, retired_key) in list(self._retired.items()):
                if retired_key == key:
                    del self._retired[name]
            self._cached.pop(key, None)

    def names(self) -> dict[str, str]:
        """Served names and the source (directory or hub id) of each one's files."""
        with self._lock:
            return {name: source for name, (source, _) in self._entries.items()}

    def resolve(self, name: str) -> ResolvedAdapter:
        """`name`'s weights, from host memory or read again (UnknownAdapter if not served)."""
        with self._lock:
            entry = self._entries.get(name) or self._retired.get(name)
            if entry is None:
                raise UnknownAdapter(name)
            source, key = entry
            weights = self._cached.get(key)
            if weights is not None:
                self._cached.move_to_end(key)
                return ResolvedAdapter(name, key, weights)
        weights = self._read(name, source)
        with self._lock:
            if key in (entry[1] for entry in (*self._entries.values(), *self._retired.values())):
                self._remember(key, weights)
        return ResolvedAdapter(name, key, weights)

    def _remember(self, key: str, weights: AdapterWeights) -> None:
        self._cached[key] = weights
        self._cached.move_to_end(key)
        while len(self._cached) > self.max_cpu_loras:
            self._cached.popitem(last=False)


class AdapterSlots:
    """Which adapter each device slot holds and how many running requests use it."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._key: list[str | None] = [None] * num_slots
        self._name: list[str | None] = [None] * num_slots
        self._users = [0] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._installs: list[tuple[int, AdapterWeights]] = []

    def _slot_of(self, key: str) -> int:
        return self._key.index(key) if key in self._key else NO_ADAPTER

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one that no running request holds."""
        idle = [s for s in range(self.num_slots) if self._users[s] == 0]
        if not idle:
            return NO_ADAPTER
        empty = [s for s in idle if self._key[s] is None]
        return empty[0] if empty else min(idle, key=lambda s: self._last_used[s])

    def can_hold(self, adapter: ResolvedAdapter) -> bool:
        return self._slot_of(adapter.key) != NO_ADAPTER or self._free_slot() != NO_ADAPTER

    def acquire(self, adapter: ResolvedAdapter) -> int:
        """A slot holding `adapter` for one more running request (`can_hold` must be true)."""
        slot = self._slot_of(adapter.key)
        if slot == NO_ADAPTER:
            slot = self._free_slot()
            assert slot != NO_ADAPTER, "acquire without can_hold"
            self._key[slot], self._name[slot] = adapter.key, adapter.name
            self._installs.append((slot, adapter.weights))
        self._users[slot] += 1
        self._last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        self._last_used[slot] = next(self._clock)

    def waits(self, request: EngineRequest) -> bool:
        """True when `request`'s adapter has no slot to go to now."""
        return request.adapter is not None and not self.can_hold(request.adapter)

    def hold(self, request: EngineRequest) -> None:
        """A request joins the batch: its adapter's slot, held until `free`."""
        if request.adapter is not None:
            request.lora_slot = self.acquire(request.adapter)

    def free(self, request: EngineRequest) -> None:
        """A request leaves the batch (finished, aborted or preempted)."""
        if request.lora_slot != NO_ADAPTER:
            self.release(request.lora_slot)
            request.lora_slot = NO_ADAPTER

    def take_installs(self) -> list[tuple[int, AdapterWeights]]:
        """Slots given a new adapter since the last call: their weights go in before the step."""
        installs, self._installs = self._installs, []
        return installs

    def running_names(self) -> list[str]:
        """Adapters that running requests use, by name."""
        return sorted({n for n, u in zip(self._name, self._users) if u and n is not None})
