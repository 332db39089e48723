"""Engine failures and overload: clear 5xx/503, the loop survives, nothing hangs or leaks."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from tests.conftest import make_engine, serving_context
from tests.reliability_helpers import metric_sum

BODY = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}


async def test_a_failing_step_fails_its_requests_with_500_and_the_loop_survives(
    client: httpx.AsyncClient, tiny_ctx: ServingContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = tiny_ctx.engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device error")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    r = await client.post("/v1/completions", json=BODY)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "simulated device error" in err["message"]
    r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")  # the loop lived on
    assert (await client.get("/health")).status_code == 200
    pool = tiny_ctx.engine.engine.pool
    assert pool.num_free == pool.num_blocks


async def test_a_dead_loop_fails_pending_requests_and_health_turns_503(llama_dir) -> None:
    ctx = serving_context(make_engine(llama_dir))
    engine = ctx.engine.engine

    class Fatal(BaseException):
        pass

    def broken_step() -> bool:
        engine._drain_inbox()  # the request is inside the engine when the loop dies
        raise Fatal("loop bug")

    app = create_app(ctx=ctx)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            engine.step = broken_step  # type: ignore[method-assign]
            r = await asyncio.wait_for(c.post("/v1/completions", json=BODY), timeout=10)
            assert r.status_code == 500
            assert (await c.get("/health")).status_code == 503
            r = await c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        ctx.engine.shutdown()


def hold_engine(ctx: ServingContext, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the engine's model step wait until the returned event is set."""
    runner = ctx.engine.engine.runner
    real = runner.execute
    gate = threading.Event()

    def held(*args, **kwargs):
        assert gate.wait(timeout=30), "test never released the engine"
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", held)
    return gate


async def test_beyond_the_waiting_queue_requests_get_503_with_retry_after(
    llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 running + 2 waiting fit; of 8 requests sent while the engine is held, exactly the 4
    beyond that are refused, and the 4 admitted ones complete once it runs."""
    ctx = serving_context(make_engine(llama_dir), max_num_seqs=2, max_waiting_requests=2)
    gate = hold_engine(ctx, monkeypatch)
    app = create_app(ctx=ctx)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            body = {"prompt": "Hello", "max_tokens": 30, "ignore_eos": True}
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(8)]
            for _ in range(1000):  # the refused ones answer at once, the engine still held
                if sum(t.done() for t in tasks) == 4:
                    break
                await asyncio.sleep(0.01)
            refused_early = [t.result().status_code for t in tasks if t.done()]
            gate.set()
            replies = await asyncio.gather(*tasks)
        assert refused_early == [503] * 4
        codes = sorted(r.status_code for r in replies)
        assert codes == [200] * 4 + [503] * 4
        for r in replies:
            if r.status_code == 503:
                assert r.headers["retry-after"] and r.json()["error"]["code"] == "overloaded"
            else:
                assert r.json()["usage"]["completion_tokens"] == 30
        assert ctx.metrics is not None
        text = ctx.metrics.render()[0].decode()
        refused = metric_sum(
            text,
            "beamline:request_failure_total",
            model_name="tiny",
            reason="overloaded",
            strategy="unknown",
        )
        assert refused == codes.count(503)
    finally:
        gate.set()
        ctx.engine.shutdown()


async def test_config_bounds_the_queue(llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_num_seqs=3, max_waiting_requests=0: three requests in flight, the fourth gets 503
    overloaded; a request with more prompts than that could never fit: 400 too_many_prompts."""
    ctx = serving_context(make_engine(llama_dir), max_num_seqs=3, max_waiting_requests=0)
    gate = hold_engine(ctx, monkeypatch)
    app = create_app(ctx=ctx)
    state = app.state.serving
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            held_requests = [asyncio.create_task(c.post("/v1/completions", json=BODY))]
            held_requests += [asyncio.create_task(c.post("/v1/completions", json=BODY))]
            held_requests += [asyncio.create_task(c.post("/v1/completions", json=BODY))]
            for _ in range(1000):  # admission happens in the handler, before the engine runs
                if state.in_flight == 3:
                    break
                await asyncio.sleep(0.01)
            assert state.in_flight == 3

            # refused at once (a wrongly admitted request would wait on the held engine)
            r = await asyncio.wait_for(c.post("/v1/completions", json=BODY), timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == (
                "service_unavailable_error",
                None,
                "overloaded",
            )
            r = await c.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c", "d"]})
            assert r.status_code == 400
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == (
                "invalid_request_error",
                "prompt",
                "too_many_prompts",
            )

            gate.set()
            replies = await asyncio.gather(*held_requests)
            assert [r.status_code for r in replies] == [200, 200, 200]
            assert all(r.json()["usage"]["completion_tokens"] == 4 for r in replies)
            assert state.in_flight == 0
            r = await c.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3  # room again
        pool = ctx.engine.engine.pool
        assert pool.num_free == pool.num_blocks
    finally:
        gate.set()
        ctx.engine.shutdown()
