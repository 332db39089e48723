"""Data parallelism on one host: `data_parallel_size` engine processes, each with a copy of the
model, its own KV pool and an equal share of the cores, behind one EngineClient.

On a small CPU model one engine's step scales poorly over its intra-op threads (small GEMMs, and
the host's Python work runs on one core while the others wait); copies of one thread each keep
every core busy, as CTranslate2's `inter_threads` does. Each request goes whole to the copy with
the fewest decode rows in flight (a request's rows, beams or `n` samples, share its KV blocks, so
they stay together). A copy's scheduler gauges are summed with the others' before /metrics shows
them; its counters add up in the shared registry as they are replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncGenerator, Callable

import torch

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.config import ServerConfig
from server.engine.client import EngineDead, KVCapacity, UnknownAdapter
from server.engine.request import RequestOutput
from server.metrics import Metrics
from server.model.kv_budget import CPU_AUTO_KV_BYTES
from server.process.client import EngineProcessClient
from server.process.messages import Ready

Number = int | float | bool | str


def replica_config(config: ServerConfig) -> ServerConfig:
    """One copy's settings: the KV pool settings are the server's total, shared out evenly (the
    copies share the host's RAM); threads are shared out by `set_threads`."""
    copies = config.data_parallel_size
    if config.num_kv_blocks is not None:
        return config.model_copy(update={"num_kv_blocks": max(1, config.num_kv_blocks // copies)})
    total = CPU_AUTO_KV_BYTES if config.kv_cache_memory == "auto" else config.kv_cache_memory
    return config.model_copy(update={"kv_cache_memory": total // copies})


def merged_stats(snapshots: list[dict[str, Number]]) -> dict[str, Number]:
    """The copies' counters as one engine's: sums, the largest of `max_*` and of `peak_*`
    values, flags as the first copy has them, the prefix cache's hit rate of the summed
    counts, the decode step's state as `merged_state` says."""
    merged: dict[str, int | float | bool] = {}
    states: dict[str, str] = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            if isinstance(value, str):
                states[key] = merged_state(states[key], value) if key in states else value
            elif key not in merged or isinstance(value, bool):
                merged.setdefault(key, value)
            elif key.startswith(("max_", "peak_")):
                merged[key] = max(merged[key], value)
            else:
                merged[key] = merged[key] + value
    if "prefix_cache_hit_rate" in merged:
        hits, queries = merged.get("prefix_cache_hits", 0), merged.get("prefix_cache_queries", 0)
        merged["prefix_cache_hit_rate"] = hits / max(1, queries)
    merged["data_parallel_size"] = len(snapshots)
    return {**merged, **states}


def merged_state(kept: str, other: str) -> str:
    """The copies' decode step: compiling while one of them is, else theirs if they agree."""
    if "compiling" in (kept, other):
        return "compiling"
    return kept if kept == other else "mixed"


class SummedGauges:
    """Keeps each copy's last scheduler state and KV pool size, and sets the shared Metrics'
    gauges to their sums (KV usage: the share of all the copies' blocks in use)."""

    def __init__(self, metrics: Metrics, copies: int) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._states = [(0, 0, 0.0)] * copies
        self._blocks = [0] * copies

    def for_copy(self, index: int) -> Metrics:
        """What copy `index`'s events are replayed on."""
        return _CopyMetrics(self, index)  # type: ignore[return-value]

    def scheduler_state(self, index: int, running: int, waiting: int, usage: float) -> None:
        with self._lock:
            self._states[index] = (running, waiting, usage)
            total = sum(self._blocks)
            used = sum(u * b for (_, _, u), b in zip(self._states, self._blocks, strict=True))
            self.metrics.set_scheduler_state(
                running=sum(s[0] for s in self._states),
                waiting=sum(s[1] for s in self._states),
                kv_cache_usage=min(used / total, 1.0) if total else 0.0,
            )

    def cache_config(self, index: int, block_size: int, num_blocks: int, caching: bool) -> None:
        with self._lock:
            self._blocks[index] = num_blocks
            self.metrics.set_cache_config(
                block_size=block_size, num_blocks=sum(self._blocks), prefix_caching=caching
            )


class _CopyMetrics:
    """Metrics as one copy's replayed events see them: the gauges summed, the rest shared."""

    def __init__(self, gauges: SummedGauges, index: int) -> None:
        self._gauges, self._index = gauges, index

    def set_scheduler_state(self, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._gauges.scheduler_state(self._index, running, waiting, kv_cache_usage)

    def set_cache_config(self, *, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self._gauges.cache_config(self._index, block_size, num_blocks, prefix_caching)

    def __getattr__(self, name: str) -> Callable[..., None]:
        return getattr(self._gauges.metrics, name)  # type: ignore[no-any-return]


class ReplicatedEngine:
    """`data_parallel_size` engine processes as one EngineClient."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics | None = None,
        make_copy: Callable[[ServerConfig, Metrics | None, int], EngineProcessClient] | None = None,
    ) -> None:
        copies = config.data_parallel_size
        gauges = SummedGauges(metrics, copies) if metrics is not None else None
        make = make_copy or _engine_process
        per_copy = replica_config(config)
        self.copies = [
            make(per_copy, gauges.for_copy(i) if gauges else None, i) for i in range(copies)
        ]
        self._rows = [0] * copies  # decode rows of the requests in flight, per copy
        self._turn = itertools.count()  # among equally loaded copies, take turns

    def start(self) -> None:
        """Start every copy at once and wait for all; if one fails, stop the others."""
        for copy in self.copies:
            copy.spawn()
        try:
            for copy in self.copies:
                copy.wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ---- what the front end reads --------------------------------------------------------------
    @property
    def ready(self) -> Ready:
        return self.copies[0].ready

    @property
    def alive(self) -> bool:
        return all(copy.alive for copy in self.copies)

    @property
    def max_model_len(self) -> int:
        return min(copy.max_model_len for copy in self.copies)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.copies[0].eos_token_ids

    @property
    def kv_capacity(self) -> KVCapacity:
        """One copy's pool: a request runs whole in one copy."""
        return min((copy.kv_capacity for copy in self.copies), key=lambda c: c.num_blocks)

    @property
    def pid(self) -> str:
        """The copies' process ids, for the log."""
        return ", ".join(str(copy.pid) for copy in self.copies)

    def stats(self) -> dict[str, Number]:
        return merged_stats([copy.stats() for copy in self.copies])

    def shutdown(self, timeout: float = 5.0) -> None:
        for copy in self.copies:
            copy.shutdown(timeout)

    # ---- requests -------------------------------------------------------------------------------
    def pick(self, rows: int) -> int:
        """The copy with the fewest decode rows in flight (taking turns among equals); its
        count grows by `rows` until `release`."""
        count = len(self.copies)
        start = next(self._turn) % count
        index = min(((start + i) % count for i in range(count)), key=self._rows.__getitem__)
        self._rows[index] += rows
        return index

    def release(self, index: int, rows: int) -> None:
        self._rows[index] -= rows

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: DecodingParams,
        grammar: Grammar | None = None,
        model: str | None = None,
        source_len: int = 0,
        source_features: torch.Tensor | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if not self.alive:
            raise EngineDead("engine is not running")
        rows = params.width
        index = self.pick(rows)
        try:
            copy = self.copies[index]
            async for out in copy.generate(
                request_id, prompt_ids, params, grammar, model, source_len, source_features
            ):
                yield out
        finally:
            self.release(index, rows)

    # ---- LoRA adapters: every copy serves the same ones ------------------------------------------
    def adapter_names(self) -> dict[str, str]:
        return self.copies[0].adapter_names()

    async def load_adapter(self, name: str, source: str) -> None:
        """Load into every copy; if one refuses, the others that took it drop it again."""
        results = await asyncio.gather(
            *(copy.load_adapter(name, source) for copy in self.copies), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for copy, result in zip(self.copies, results, strict=True):
                if not isinstance(result, BaseException):
                    copy.unload_adapter(name)
            raise failed[0]

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapter_names():
            raise UnknownAdapter(name)
        for copy in self.copies:
            copy.unload_adapter(name)


def _engine_process(
    config: ServerConfig, metrics: Metrics | None, index: int
) -> EngineProcessClient:
    return EngineProcessClient(config, metrics, name=f"beamline-engine-{index}")
