"""Drive an Engine synchronously (no thread) and collect what each request streamed."""

from __future__ import annotations

from dataclasses import dataclass, field

from decoding import DecodingParams
from server.engine.engine import Engine
from server.engine.request import EngineRequest, RequestOutput


@dataclass
class Collected:
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None


def submit(engine: Engine, request_id: str, prompt_ids: list[int], params: DecodingParams) -> Collected:
    got = Collected()
    engine.submit(EngineRequest(request_id, list(prompt_ids), params, got.outputs.append))
    return got


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.step():
            return
    raise AssertionError("engine did not finish")


def generate(engine: Engine, prompts: list[list[int]], params: DecodingParams) -> list[Collected]:
    results = [submit(engine, str(i), p, params) for i, p in enumerate(prompts)]
    run_to_completion(engine)
    return results
