"""Overlapped output processing gives the same outputs as rendering each step at once.

With `overlap_outputs` the engine renders a step's text (detokenization, stop strings, streaming)
after it has queued the next step's forward, so that on a GPU the text work runs while the device
computes. A row ended by a stop string then has one more token computed, which must be dropped:
not streamed, not counted, its blocks returned. On the CPU the forward is synchronous, but the
code path (the order of the work, the dropped tokens) is the same one, tested here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from decoding import DecodingParams
from server.api.app import create_app
from server.engine.engine import Engine
from server.engine.request import RequestOutput
from server.loading import overlaps_outputs
from tests.conftest import make_engine, serving_context
from tests.engine_driver import Collected, run_to_completion, submit
from tests.test_api import sse_events

PROMPTS = [
    "Hello world! How are you",
    "The quick brown fox",
    "Once upon a time",
    "Numbers: 1 2 3 4",
    "Unicode: café, 東京",
    "def main():",
]


def free_run_text(engine: Engine, prompt: list[int]) -> str:
    got = submit(engine, "probe", prompt, DecodingParams(max_tokens=24, temperature=0.0))
    run_to_completion(engine)
    return got.text


def workload(engine: Engine) -> list[tuple[list[int], DecodingParams]]:
    """Greedy, seeded sampling with penalties, n, best_of, beams, logprobs, max_tokens, and stop
    strings that hit in the middle of generation (taken from each prompt's own free-run text)."""
    tok = engine.tokenizer
    work = []
    for i, text in enumerate(PROMPTS):
        prompt = tok(text).input_ids
        free = free_run_text(engine, prompt)
        needle = free[len(free) // 3 : len(free) // 3 + 2]
        stop = (needle,) if needle.strip() else ()
        work += [
            (prompt, DecodingParams(max_tokens=24, temperature=0.0, stop=stop)),
            (prompt, DecodingParams(max_tokens=5 + i, temperature=0.0, logprobs=2)),
            (
                prompt,
                DecodingParams(
                    max_tokens=20,
                    temperature=0.9,
                    top_k=30,
                    top_p=0.9,
                    repetition_penalty=1.2,
                    seed=i,
                    n=2,
                    stop=stop,
                ),
            ),
            (prompt, DecodingParams(max_tokens=12, temperature=0.8, seed=i, best_of=3, n=2)),
            (prompt, DecodingParams(max_tokens=10, temperature=0.0, num_beams=3, stop=stop)),
        ]
    return work


def run(engine: Engine, work: list[tuple[list[int], DecodingParams]]) -> list[Collected]:
    got = [submit(engine, str(i), prompt, params) for i, (prompt, params) in enumerate(work)]
    run_to_completion(engine)
    return got


def outputs(got: Collected) -> list[tuple[object, ...]]:
    """Everything a client sees, output by output."""

    def fields(o: RequestOutput) -> tuple[object, ...]:
        # logprobs rounded: the two engines batch rows differently (a stop-string row runs one
        # step longer), which moves float32 sums in the last bits
        lps = [(t.token_id, round(t.logprob, 4)) for t in o.logprobs or []]
        return (o.index, o.text, o.token_ids, o.finish_reason, o.completion_tokens, lps)

    return [fields(o) for o in got.outputs]


def test_overlapped_outputs_equal_immediate_ones(llama_dir: Path) -> None:
    plain = make_engine(llama_dir, max_num_seqs=64, max_num_batched_tokens=256)
    overlapped = make_engine(
        llama_dir, max_num_seqs=64, max_num_batched_tokens=256, overlap_outputs=True
    )
    work = workload(make_engine(llama_dir))  # probed elsewhere: both engines start cold
    expected, got = run(plain, work), run(overlapped, work)
    stopped = [g for g, (_, p) in zip(got, work) if p.stop and g.finish_reason == "stop"]
    assert len(stopped) >= 5  # stop strings did end rows mid-way (one token later dropped)
    for want, have in zip(expected, got):
        assert have.finished
        assert outputs(have) == outputs(want)
    for engine in (plain, overlapped):
        assert engine.pool.num_free == engine.pool.num_blocks
        assert not engine.scheduler.has_work() and not engine.output.has_pending
    assert overlapped.stats.tokens_generated == plain.stats.tokens_generated


def test_a_row_ended_by_a_stop_string_computes_one_token_more_and_drops_it(
    llama_dir: Path,
) -> None:
    """The overlapped engine schedules the row once more before it sees the stop string."""
    engines = [make_engine(llama_dir), make_engine(llama_dir, overlap_outputs=True)]
    prompt = engines[0].tokenizer(PROMPTS[0]).input_ids
    free = free_run_text(make_engine(llama_dir), prompt)
    needle = free[len(free) // 2 : len(free) // 2 + 2]
    params = DecodingParams(max_tokens=24, temperature=0.0, stop=(needle,))
    computed = []
    for engine in engines:
        rows_run = 0
        step = engine.runner.execute

        def counting(plan, step=step):  # type: ignore[no-untyped-def]
            nonlocal rows_run
            rows_run += plan.num_tokens
            return step(plan)

        engine.runner.execute = counting  # type: ignore[method-assign]
        got = submit(engine, "r", prompt, params)
        run_to_completion(engine)
        assert got.finish_reason == "stop" and got.text == free[: free.index(needle)]
        assert engine.pool.num_free == engine.pool.num_blocks
        computed.append(rows_run)
    assert computed[1] == computed[0] + 1


def test_an_abort_before_the_text_is_rendered_ends_the_request_once(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, overlap_outputs=True)
    prompt = engine.tokenizer(PROMPTS[1]).input_ids
    got = submit(engine, "r", prompt, DecodingParams(max_tokens=50, temperature=0.0))
    for _ in range(4):
        engine.step()
    assert engine.output.has_pending  # the last step's token is committed, its text not out
    engine.abort("r")
    run_to_completion(engine)
    assert [o.request_done for o in got.outputs].count(True) == 1
    assert got.outputs[-1].finish_reason == "abort"
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.output.has_pending


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False)],
)
def test_overlap_setting(setting: str, device: str, expected: bool) -> None:
    assert overlaps_outputs(setting, device) is expected


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_streams_over_http_are_whole_with_overlap_and_batched_delivery(
    llama_dir: Path, async_scheduling: bool
) -> None:
    """Through AsyncEngine (outputs handed to the event loop once per step) with overlap on (and
    async scheduling, test_async_scheduling.py): streamed text equals the non-streamed text, stop
    strings included, for concurrent clients."""
    engine = make_engine(llama_dir, overlap_outputs=True, async_scheduling=async_scheduling)
    ctx = serving_context(engine)
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            base = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
            probe = await client.post("/v1/completions", json={**base, "prompt": PROMPTS[0]})
            text = probe.json()["choices"][0]["text"]
            needle = text[len(text) // 2 : len(text) // 2 + 2]
            reqs = [{**base, "prompt": p} for p in PROMPTS] + [
                {**base, "prompt": PROMPTS[0], "stop": [needle]}
            ]
            plain = await asyncio.gather(*(client.post("/v1/completions", json=r) for r in reqs))
            streams = await asyncio.gather(
                *(client.post("/v1/completions", json={**r, "stream": True}) for r in reqs)
            )
        for whole, streamed in zip(plain, streams):
            events = sse_events(streamed.text)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"] for e in events[:-1]]
            assert "".join(c[0]["text"] for c in chunks if c) == whole.json()["choices"][0]["text"]
            reasons = [c[0]["finish_reason"] for c in chunks if c and c[0]["finish_reason"]]
            assert reasons == [whole.json()["choices"][0]["finish_reason"]]
        assert plain[-1].json()["choices"][0]["finish_reason"] == "stop"
        assert plain[-1].json()["choices"][0]["text"] == text[: text.index(needle)]
    finally:
        ctx.engine.shutdown()
