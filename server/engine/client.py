"""What the HTTP front end needs of an engine, wherever it runs: its own thread in this process
(async_engine.AsyncEngine) or a process of its own (server/process/client.py).

Both hand each request an async stream of RequestOutputs; `OutputStream` is that stream's
consumer side, shared by both: outputs arrive in an asyncio.Queue, those that queued up while the
consumer was busy come merged, and leaving early aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from decoding import DecodingParams
from decoding.grammar import Grammar
from server.engine.request import RequestOutput


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class UnknownAdapter(KeyError):
    """No LoRA adapter of that name is loaded."""


class AdapterLoadError(ValueError):
    """A LoRA adapter that could not be loaded: its files do not fit the model, its name is
    taken, or adapters are off; the message says which."""


@dataclass(frozen=True)
class KVCapacity:
    """The KV-cache pool's size, for checks the front end makes before it submits a request."""

    num_blocks: int
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        """Blocks one row of `tokens` tokens occupies."""
        return -(-tokens // self.block_size)

    def tokens_per_row(self, width: int) -> int:
        """Tokens each of `width` rows can hold when the pool is split evenly between them."""
        return (self.num_blocks // width) * self.block_size


class EngineClient(Protocol):
    """The engine as the front end sees it."""

    @property
    def alive(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids (a grammar may end only where it is complete)."""
        ...

    @property
    def kv_capacity(self) -> KVCapacity: ...

    def stats(self) -> dict[str, int | float | bool | str]:
        """The engine's counters since start-up (GET /v1/engine/stats)."""
        ...

    def shutdown(self, timeout: float = 5.0) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: DecodingParams,
        grammar: Grammar | None = None,
        model: str | None = None,
        source_len: int = 0,
        source_features: torch.Tensor | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit one request and yield its outputs until every choice has finished (each row
        constrained by `grammar`, when given; through the LoRA adapter or on the extra model
        `model` names, when given; an encoder-decoder model's prompt is its `source_len`
        source ids, then the decoder's prompt; a speech model's source ids are placeholders of
        its audio's `source_features`). Leaving the iteration early aborts the request."""
        ...

    def adapter_names(self) -> dict[str, str]:
        """The LoRA adapters served now: name -> source (directory or hub id)."""
        ...

    async def load_adapter(self, name: str, source: str) -> None:
        """Serve the adapter at `source` as `name`; AdapterLoadError says why not."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Stop serving `name` (adapters.UnknownAdapter if it is not served); requests already
        submitted finish with it."""
        ...


def merge_into(batch: list[RequestOutput], out: RequestOutput) -> None:
    """Add `out` to the outputs not yet handed on: merged into the last one of its choice when
    they can be one delta (RequestOutput.merged), else appended. The request's last output is
    merged only into the batch's last: nothing may follow it."""
    for i in range(len(batch) - 1, -1, -1):
        if batch[i].index == out.index:
            if not out.request_done or i == len(batch) - 1:
                merged = batch[i].merged(out)
                if merged is not None:
                    batch[i] = merged
                    return
            break
    batch.append(out)


async def stream_outputs(
    outputs: asyncio.Queue[RequestOutput], abort: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """Yield a request's outputs from `outputs` until its last one; a consumer that fell behind
    gets one delta per choice (`merge_into`). Leaving early (client gone, task cancelled) calls
    `abort`, which frees the request's KV blocks at the engine's next step."""
    done = False
    try:
        while not done:
            batch = [await outputs.get()]
            while not outputs.empty():
                merge_into(batch, outputs.get_nowait())
            for out in batch:
                done = out.request_done
                yield out
    finally:
        if not done:
            abort()
