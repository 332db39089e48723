"""Drive an Engine synchronously (no thread) and collect what each request streamed."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decoding import DecodingParams
from server.engine.engine import Engine
from server.engine.request import EngineRequest, RequestOutput, Sequence
from server.step_plan import NO_ADAPTER


@dataclass(eq=False)
class StubRequest:
    """What the scheduler needs of a request: its rows, its width, where its prompt still needs
    computing for prompt logprobs, its priority and prefix-cache salt, the tokens it ranks (no
    decoding state)."""

    rows: list[Sequence] = field(default_factory=list)
    width: int = 1
    unscored_from: int | None = None
    cache_limit: int | None = None
    scores_prompt: bool = False
    returns_logprobs: bool = False
    priority: int = 0
    cache_salt: str | None = None
    companion: str | None = None  # no LM fusion
    model: str | None = None  # the served model
    adapter: object | None = None  # no LoRA adapter
    adapter_key: str | None = None
    lora_slot: int = NO_ADAPTER
    source_len: int = 0  # a decoder-only model's request
    ranked_tokens: int = 0  # reads every token (the int8 head re-scores all its candidates)


def stub_rows(token_ids: list[int], rows: int = 1) -> StubRequest:
    req = StubRequest(width=rows)
    for _ in range(rows):
        req.rows.append(Sequence(req, list(token_ids), len(token_ids)))  # type: ignore[arg-type]
    return req


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
        return bool(self.outputs) and self.outputs[-1].request_done

    def choices(self) -> dict[int, tuple[str, list[int], str | None]]:
        """Per choice index: (text, token ids, finish reason)."""
        text: dict[int, str] = defaultdict(str)
        tokens: dict[int, list[int]] = defaultdict(list)
        reasons: dict[int, str | None] = {}
        for o in self.outputs:
            text[o.index] += o.text
            tokens[o.index] += o.token_ids
            if o.finished:
                reasons[o.index] = o.finish_reason
        return {i: (text[i], tokens[i], reasons.get(i)) for i in sorted(text)}

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None


def submit(
    engine: Engine,
    request_id: str,
    prompt_ids: list[int],
    params: DecodingParams,
    model: str | None = None,
    source_len: int = 0,
) -> Collected:
    """`model`: the name of a LoRA adapter or an extra model the engine serves (None: the
    served model);
    `source_len`: an encoder-decoder request's source, the prompt's first ids."""
    got = Collected()
    request = EngineRequest(
        request_id, list(prompt_ids), params, got.outputs.append, source_len=source_len
    )
    request.model_name = model
    engine.submit(request)
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


class Counted:
    """Stands in for `fn` (a runner's decode step) and counts the calls it passes on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)
