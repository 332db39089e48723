"""Beam-search case: one greedy and one `num_beams: 4` request, one after the other, on one server.

Reports the time ratio and KV blocks used. KV usage comes from `GET /v1/engine/stats`
(`kv_blocks_total`, `kv_blocks_free`, `peak_kv_blocks_used`): it is polled while each request runs
(sampled peak of total - free) and read after it (the server's own peak since start, which only
isolates a request if nothing bigger ran before, so run this case on a fresh server). A server
without that endpoint still gets the timings. A 2-token warm-up request goes first, unmeasured.
"""

from __future__ import annotations

import asyncio
import time

import httpx

BEAM_PROMPT = "The three most important things to remember when learning to ride a bicycle are"
POLL_INTERVAL_S = 0.1  # a trivial JSON endpoint 10x/s: negligible next to 50-100 ms engine steps


async def engine_stats(client: httpx.AsyncClient, base_url: str) -> dict | None:
    """The engine stats JSON, or None if the server has no such endpoint (404) or it fails."""
    try:
        resp = await client.get(base_url + "/v1/engine/stats")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    data = resp.json()
    return data if isinstance(data, dict) and "kv_blocks_total" in data else None


def _used(stats: dict | None) -> int | None:
    return None if stats is None else int(stats["kv_blocks_total"]) - int(stats["kv_blocks_free"])


async def _one(client: httpx.AsyncClient, base_url: str, body: dict) -> dict:
    before = await engine_stats(client, base_url)
    peak_sampled = _used(before)
    done = asyncio.Event()

    async def poll() -> None:
        nonlocal peak_sampled
        while not done.is_set() and before is not None:
            used = _used(await engine_stats(client, base_url))
            if used is not None:
                peak_sampled = max(peak_sampled or 0, used)
            await asyncio.sleep(POLL_INTERVAL_S)

    poller = asyncio.create_task(poll())
    start = time.perf_counter()
    resp: httpx.Response | None = None
    error = ""
    try:
        resp = await client.post(base_url + "/v1/completions", json=body)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        await poller
    after = await engine_stats(client, base_url)
    status = resp.status_code if resp is not None else 0
    out: dict = {
        "request": {k: v for k, v in body.items() if k != "prompt"},
        "status": status,
        "seconds": elapsed,
        "kv_blocks_used_before": _used(before),
        "kv_blocks_used_peak_sampled": peak_sampled,
        "peak_kv_blocks_used_since_start": after.get("peak_kv_blocks_used") if after else None,
    }
    if resp is not None and status == 200:
        data = resp.json()
        out["text"] = data["choices"][0].get("text", "") if data.get("choices") else ""
        out["completion_tokens"] = (data.get("usage") or {}).get("completion_tokens")
    else:
        out["error"] = error or (resp.text[:300] if resp is not None else "")
    return out


async def run_beam_case(
    base_url: str,
    model: str,
    max_tokens: int = 64,
    ignore_eos: bool = True,
    num_beams: int = 4,
    api_key: str | None = None,
) -> dict:
    base_url = base_url.rstrip("/")
    common = {"model": model, "prompt": BEAM_PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        common["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(900.0, connect=30.0), headers=headers
    ) as client:
        warm = await client.post(base_url + "/v1/completions", json={**common, "max_tokens": 2})
        stats_available = await engine_stats(client, base_url) is not None
        greedy = await _one(client, base_url, common)
        beam = await _one(client, base_url, {**common, "num_beams": num_beams})
    ok = greedy["status"] == 200 and beam["status"] == 200
    g_kv, b_kv = greedy["kv_blocks_used_peak_sampled"], beam["kv_blocks_used_peak_sampled"]
    result = {
        "prompt": BEAM_PROMPT,
        "max_tokens": max_tokens,
        "num_beams": num_beams,
        "engine_stats_available": stats_available,
        "warmup_status": warm.status_code,
        "greedy": greedy,
        "beam": beam,
        "time_ratio": beam["seconds"] / greedy["seconds"] if ok and greedy["seconds"] > 0 else None,
        "kv_blocks_ratio": b_kv / g_kv if ok and g_kv and b_kv is not None else None,
        "notes": [],
    }
    if not stats_available:
        result["notes"].append("GET /v1/engine/stats unavailable: KV blocks not reported")
    if ok and greedy.get("text") == beam.get("text"):
        result["notes"].append(
            "beam text equals greedy text (possible, or the server ignored num_beams)"
        )
    return result


def format_beam_case(res: dict) -> str:
    def row(name: str, r: dict) -> str:
        kv = r["kv_blocks_used_peak_sampled"]
        return (
            f"  {name:<8} status {r['status']}  {r['seconds']:.2f} s  "
            f"tokens {r.get('completion_tokens', '-')}"
            f"  KV blocks peak {kv if kv is not None else '-'}"
            f" (server peak since start {r['peak_kv_blocks_used_since_start'] or '-'})"
        )

    tr, kr = res["time_ratio"], res["kv_blocks_ratio"]
    lines = [
        f"beam case: {res['max_tokens']} tokens, greedy vs num_beams={res['num_beams']}",
        row("greedy", res["greedy"]),
        row("beam", res["beam"]),
        f"  time ratio beam/greedy: {'-' if tr is None else f'{tr:.2f}'}"
        f"   KV blocks ratio: {'-' if kr is None else f'{kr:.2f}'}",
    ]
    lines += [f"  note: {n}" for n in res["notes"]]
    return "\n".join(lines)
