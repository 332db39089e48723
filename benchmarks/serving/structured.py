"""Structured-output workload: every request with a JSON schema, against the same requests
unconstrained, in one run (`python -m benchmarks.serve --structured`).

The constrained pass sends the 52 chat requests of benchmarks/schema_suite.py ("Give an example of
<what> as JSON.", `response_format: json_schema`, greedy, no `ignore_eos`). The unconstrained pass
sends the same messages with no schema, `ignore_eos: true` and each request's `max_tokens` set to
the length its constrained output had, so both passes generate the same number of tokens per
request. At each concurrency the passes run constrained, unconstrained, unconstrained, constrained
(A B B A) and each side's tok/s is taken over both of its passes, so a drift of the machine's
speed during the run cancels out. Before them every prompt is sent once unmeasured (1 token): that
warms the server up and puts every prompt in the prefix cache, so neither side gets a head start.
The report gives output tok/s of each side and their ratio, how many constrained outputs validate
and stopped on their own, grammar compile time p50 / p99 (from the server's `/metrics` histogram:
bucket upper bounds) and the mean time per engine step to build the constrained rows' mask (from
`/v1/engine/stats`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import jsonschema

from benchmarks.client import CompletionTarget, make_client, stream_completion
from benchmarks.schema_suite import SCHEMAS
from benchmarks.serving.beam_case import engine_stats
from benchmarks.stats import RequestResult
from benchmarks.workload import BenchRequest

MAX_TOKENS = 200


@dataclass
class Pass:
    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def errors(self) -> int:
        return sum(not r.success for r in self.results)


def _chat_body(model: str, index: int, schema: dict | None, max_tokens: int) -> dict:
    what = SCHEMAS[index][0]
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": f"Give an example of {what} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "example", "schema": schema},
        }
    return body


async def _run_pass(target: CompletionTarget, bodies: Sequence[dict], concurrency: int) -> Pass:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    out = Pass()

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            req = BenchRequest(i, "", bodies[i]["max_tokens"])
            out.results.append(
                await stream_completion(
                    client, target, req, body=bodies[i], path="/v1/chat/completions"
                )
            )

    async with make_client(concurrency, target.request_timeout_s, target.api_key) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        out.duration_s = time.perf_counter() - start
    out.results.sort(key=lambda r: r.index)
    return out


def _tok_s(passes: list[Pass]) -> float:
    seconds = sum(p.duration_s for p in passes)
    return sum(p.output_tokens for p in passes) / seconds if seconds else 0.0


def _valid(result: RequestResult, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(result.text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return result.success


async def _metrics_text(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        resp = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return ""
    return resp.text if resp.status_code == 200 else ""


def histogram_quantile(metrics: str, name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of a Prometheus histogram."""
    buckets = [
        (float("inf") if le == "+Inf" else float(le), float(count))
        for le, count in re.findall(
            rf'^{re.escape(name)}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', metrics, re.M
        )
    ]
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in sorted(buckets) if count >= q * total)


async def run_structured(
    base_url: str, model: str, concurrency: Sequence[int], api_key: str | None = None
) -> dict:
    target = CompletionTarget(base_url, model, ignore_eos=False, api_key=api_key)
    report: dict = {"schemas": len(SCHEMAS), "max_tokens": MAX_TOKENS, "runs": []}
    async with make_client(2, 60.0, api_key) as client:
        await _run_pass(target, [_chat_body(model, i, None, 1) for i in range(len(SCHEMAS))], 4)
        for c in concurrency:
            constrained_bodies = [
                _chat_body(model, i, schema, MAX_TOKENS) for i, (_, schema) in enumerate(SCHEMAS)
            ]
            before = await engine_stats(client, base_url) or {}
            first = await _run_pass(target, constrained_bodies, c)
            after = await engine_stats(client, base_url) or {}
            lengths = [max(1, r.output_tokens) for r in first.results]
            free_bodies = [_chat_body(model, i, None, n) for i, n in enumerate(lengths)]
            free = [await _run_pass(target, free_bodies, c) for _ in range(2)]
            second = await _run_pass(target, constrained_bodies, c)
            steps = after.get("constraint_mask_steps", 0) - before.get("constraint_mask_steps", 0)
            mask_s = after.get("constraint_mask_seconds", 0.0) - before.get(
                "constraint_mask_seconds", 0.0
            )
            constrained_tok_s = _tok_s([first, second])
            free_tok_s = _tok_s(free)
            report["runs"].append(
                {
                    "concurrency": c,
                    "constrained_tok_s": constrained_tok_s,
                    "unconstrained_tok_s": free_tok_s,
                    "ratio": constrained_tok_s / free_tok_s if free_tok_s else None,
                    "passes_tok_s": [first.tok_s, free[0].tok_s, free[1].tok_s, second.tok_s],
                    "output_tokens": [first.output_tokens, free[0].output_tokens],
                    "errors": [first.errors + second.errors, free[0].errors + free[1].errors],
                    "valid": sum(_valid(r, s) for r, (_, s) in zip(first.results, SCHEMAS)),
                    "mask_steps": steps,
                    "mask_ms_per_step": 1000 * mask_s / steps if steps else None,
                }
            )
        metrics = await _metrics_text(client, base_url)
    name = "beamline:grammar_compile_seconds"
    report["compile_s_p50_bucket"] = histogram_quantile(metrics, name, 0.5)
    report["compile_s_p99_bucket"] = histogram_quantile(metrics, name, 0.99)
    return report


def format_structured(report: dict) -> str:
    lines = [
        f"structured workload: {report['schemas']} JSON schemas, greedy, max_tokens "
        f"{report['max_tokens']}; unconstrained: same lengths, ignore_eos; passes A B B A",
        "c   constrained tok/s  unconstrained tok/s  ratio  valid  mask ms/step",
    ]
    for run in report["runs"]:
        ratio = f"{run['ratio']:.2f}" if run["ratio"] else "-"
        mask = f"{run['mask_ms_per_step']:.2f}" if run["mask_ms_per_step"] is not None else "-"
        lines.append(
            f"{run['concurrency']:<3} {run['constrained_tok_s']:17.1f}  "
            f"{run['unconstrained_tok_s']:19.1f}  {ratio:>5}  "
            f"{run['valid']:>2}/{report['schemas']}  {mask:>12}"
        )
    p50, p99 = report["compile_s_p50_bucket"], report["compile_s_p99_bucket"]
    if p50 is not None:
        lines.append(f"grammar compile time (histogram buckets): p50 <= {p50 * 1000:g} ms, "
                     f"p99 <= {p99 * 1000:g} ms")  # fmt: skip
    return "\n".join(lines)
