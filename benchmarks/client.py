"""Streaming client for any OpenAI-compatible `/v1/completions`, and the two load patterns.

Closed loop (`run_concurrency`): exactly `concurrency` requests in flight until the workload is
done.
Open loop (`run_poisson`): requests start at seeded Poisson arrival times whatever the server does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm.auto import tqdm

from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest


@dataclass(frozen=True)
class CompletionTarget:
    """Where and how to send requests. `extra` is merged into every request body."""

    base_url: str
    model: str
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    extra: tuple[tuple[str, object], ...] = ()
    api_key: str | None = None
    chat: bool = False  # send each prompt as a user message to /v1/chat/completions

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        body |= {
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(dict(self.extra))
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_client(
    concurrency: int, timeout_s: float, api_key: str | None = None
) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4
    )
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits, headers=auth_headers(api_key)
    )


def _error_text(payload: object) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message", payload["error"]))
    return str(payload)[:200]


async def stream_completion(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    req: BenchRequest,
    body: dict | None = None,
    path: str | None = None,
) -> RequestResult:
    """Send one streaming request (`target.body(req)` to `target.path`, or `body` to `path`) and
    time it. Never raises: failures become `success=False`."""
    result = RequestResult(
        index=req.index, expected_output_tokens=req.max_tokens if target.ignore_eos else None
    )
    url = target.base_url.rstrip("/") + (path or target.path)
    chunks_with_text = 0
    usage_tokens: int | None = None
    texts: list[str] = []
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body or target.body(req)) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    msg = _error_text(json.loads(raw))
                except ValueError:
                    msg = raw.decode(errors="replace")[:200]
                result.error = f"HTTP {resp.status_code}: {msg}"
                result.e2el = time.perf_counter() - start
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = f"stream error: {_error_text(payload)}"
                    break
                now = time.perf_counter()
                text = _chunk_text(payload)
                if text:
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                    texts.append(text)
                usage = payload.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (httpx.HTTPError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2el = time.perf_counter() - start
    result.text = "".join(texts)
    result.output_tokens = int(usage_tokens) if usage_tokens is not None else chunks_with_text
    if chunks_with_text == 0:
        result.ttft = result.e2el
    result.success = not result.error
    return result


def _chunk_text(payload: dict) -> str:
    """Output text of a completions (or chat) chunk; '' for chunks that carry no token."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


MIN_LEVEL_REQUESTS = 8  # a level's floor under --rounds: enough for a p50 at c = 1


def level_requests(
    requests: Sequence[BenchRequest], concurrency: int, rounds: int | None
) -> Sequence[BenchRequest]:
    """The requests one concurrency level runs: all of them, or with `rounds` the first
    rounds x concurrency (at least MIN_LEVEL_REQUESTS), so that c = 1 does not take as long as
    the whole workload in series while high levels still fill every slot."""
    if not rounds:
        return requests
    return requests[: max(MIN_LEVEL_REQUESTS, rounds * concurrency)]


async def run_concurrency(
    target: CompletionTarget, requests: Sequence[BenchRequest], concurrency: int, desc: str = ""
) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` workers take requests in workload order; results, wall time."""
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results: list[RequestResult] = []
    bar = tqdm(total=len(requests), desc=desc or f"c={concurrency}", unit="req", leave=False)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                req = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await stream_completion(client, target, req))
            bar.update()

    async with make_client(concurrency, target.request_timeout_s, target.api_key) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(max(1, concurrency))))
        duration = time.perf_counter() - start
    bar.close()
    return sorted(results, key=lambda r: r.index), duration


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seeded arrival offsets (s) of a Poisson process of `rate` requests per second."""
    if rate <= 0:
        raise ValueError("request rate must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_poisson(
    target: CompletionTarget,
    requests: Sequence[BenchRequest],
    rate: float,
    seed: int,
    max_concurrency: int | None = None,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Open loop: request i starts at its Poisson arrival time (optionally capped in flight)."""
    arrivals = poisson_arrivals(len(requests), rate, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc or f"rate={rate:g}/s", unit="req", leave=False)

    async def one(
        client: httpx.AsyncClient, req: BenchRequest, at: float, t0: float
    ) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if limit is None:
            res = await stream_completion(client, target, req)
        else:
            async with limit:
                res = await stream_completion(client, target, req)
        bar.update()
        return res

    async with make_client(
        max_concurrency or len(requests), target.request_timeout_s, target.api_key
    ) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one(client, r, a, start) for r, a in zip(requests, arrivals))
        )
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration
