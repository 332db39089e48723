"""Clients that go away: every abandoned request is aborted within an engine step or so, its KV
blocks return to the pool, its admission slot is released, and `request_failure_total{reason=
"aborted"}` counts it. Runs through a real uvicorn on 127.0.0.1 with raw sockets, so the cut point
(mid-body, before the response, after the headers, after k events, after a delay; FIN or RST) is
exact and seeded.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from decoding import DecodingParams
from decoding.grammar import GrammarConstraint
from server.api.app import create_app
from server.api.serving import ServingContext
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server
from tests.reliability_helpers import (
    PROBE,
    aborted_total,
    completion_text,
    engine_stats,
    wait_until_idle,
)

NUM_STREAMS = 100
CONCURRENCY = 16
SEED = 20240605
LONG = 200  # max_tokens of a request that is always cut long before it could finish


@dataclass
class Server:
    url: str
    host: str
    port: int
    ctx: ServingContext


@pytest.fixture(scope="module")
def server(tiny_model_dirs: dict[str, Path]) -> Iterator[Server]:
    ctx = serving_context(make_engine(tiny_model_dirs["llama"]))
    try:
        with live_server(create_app(ctx=ctx)) as url:
            parts = urlsplit(url)
            yield Server(url, parts.hostname or "127.0.0.1", parts.port or 80, ctx)
    finally:
        ctx.engine.shutdown()


# ---- raw HTTP over asyncio streams ---------------------------------------------------------------
def raw_request(path: str, body: dict[str, Any], host: str) -> tuple[bytes, bytes]:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    return head, payload


async def hang_up(writer: asyncio.StreamWriter, reset: bool) -> None:
    """Close the connection: a FIN, or an RST (SO_LINGER 0) like a crashed client."""
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def read_events(reader: asyncio.StreamReader, count: int, timeout: float) -> None:
    """Read the response head, then `count` SSE events."""
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    for _ in range(count):
        await asyncio.wait_for(reader.readuntil(b"\n\n"), timeout)


@dataclass(frozen=True)
class Cut:
    kind: str  # mid_body | before_response | after_headers | after_events | after_delay
    events: int = 0
    delay: float = 0.0
    reset: bool = False


def random_cut(rng: random.Random) -> Cut:
    kind = rng.choice(
        [
            "mid_body",
            "before_response",
            "after_headers",
            "after_events",
            "after_events",
            "after_delay",
        ]
    )
    return Cut(
        kind, events=rng.randint(1, 30), delay=rng.uniform(0.0, 0.3), reset=rng.random() < 0.5
    )


def random_stream_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"max_tokens": LONG, "ignore_eos": True, "stream": True}
    style = rng.choice(["greedy", "seeded", "n2", "chat", "stop", "beams", "best_of"])
    if style == "greedy":
        return "/v1/completions", {**common, "prompt": "Once upon a time", "temperature": 0}
    if style == "seeded":
        return "/v1/completions", {
            **common,
            "prompt": "Hello world",
            "temperature": 0.8,
            "seed": rng.randint(0, 99),
        }
    if style == "n2":
        return "/v1/completions", {**common, "prompt": ["The quick", "A journey"], "n": 2}
    if style == "stop":
        return "/v1/completions", {**common, "prompt": "Numbers: 0 1 2", "stop": ["zzzz", "qqqq"]}
    if style == "beams":  # shared, copy-on-write blocks; nothing is streamed before the end
        return "/v1/completions", {**common, "prompt": "To be or not", "num_beams": 3, "n": 2}
    if style == "best_of":
        return "/v1/completions", {**common, "prompt": "The early bird", "best_of": 3, "seed": 1}
    return "/v1/chat/completions", {
        **common,
        "messages": [{"role": "user", "content": "Tell me a story"}],
    }


def planned(
    request: tuple[str, dict[str, Any]], cut: Cut
) -> tuple[tuple[str, dict[str, Any]], Cut]:
    """Beams and best_of send their choices only at the end: cut those after a delay instead."""
    _, body = request
    if cut.kind == "after_events" and ("num_beams" in body or "best_of" in body):
        cut = Cut("after_delay", delay=cut.delay, reset=cut.reset)
    return request, cut


def engine_requests(body: dict[str, Any]) -> int:
    """Engine requests one API request becomes: one per prompt (the metrics count these)."""
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else 1


async def cut_stream(server: Server, path: str, body: dict[str, Any], cut: Cut) -> str:
    """Open a streaming request and hang up at `cut`; returns how far it got."""
    head, payload = raw_request(path, body, server.host)
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        if cut.kind == "mid_body":
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            await asyncio.sleep(cut.delay)
            return "mid_body"
        writer.write(head + payload)
        await writer.drain()
        if cut.kind == "before_response":
            return "before_response"
        if cut.kind == "after_headers":
            await read_events(reader, 0, timeout=30)
        elif cut.kind == "after_events":
            try:
                await read_events(reader, cut.events, timeout=30)
            except asyncio.IncompleteReadError:  # it ended first (an unseeded stop string hit)
                return "ended"
        else:
            await asyncio.sleep(cut.delay)
        return cut.kind
    finally:
        await hang_up(writer, cut.reset)


async def metrics_text(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return r.text


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
async def test_a_hundred_streams_cut_at_random_points_leave_nothing_behind(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(SEED)
    plan = [planned(random_stream_body(rng), random_cut(rng)) for _ in range(NUM_STREAMS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        probe_before = completion_text((await client.post("/v1/completions", json=PROBE)).json())
        aborted_before = aborted_total(await metrics_text(client))

        async def one(path: str, body: dict[str, Any], cut: Cut) -> str:
            async with gate:
                return await cut_stream(server, path, body, cut)

        caplog.set_level(logging.ERROR)
        kinds = await asyncio.gather(*(one(p, b, c) for (p, b), c in plan))
        outcomes: Counter[str] = Counter()
        for kind, ((_, body), _) in zip(kinds, plan):
            outcomes[kind] += engine_requests(body)
        last_cut = time.monotonic()
        stats = await wait_until_idle(client, timeout=2.0)
        idle_after = time.monotonic() - last_cut

        # Every request that was streaming when cut was aborted (and nothing else was counted).
        aborted = aborted_total(await metrics_text(client)) - aborted_before
        assert outcomes["after_events"] <= aborted <= outcomes.total() - outcomes["mid_body"], (
            aborted,
            outcomes,
        )
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        # The server still answers, with the same text as before the storm.
        r = await client.post("/v1/completions", json=PROBE)
        assert r.status_code == 200 and completion_text(r.json()) == probe_before
        await wait_until_idle(client, timeout=2.0)
    unhandled = [
        rec.getMessage()
        for rec in caplog.records
        if rec.levelno >= logging.ERROR and rec.name.startswith(("server", "beamline", "uvicorn"))
    ]
    assert not unhandled, f"server logged errors for client disconnects: {unhandled[:3]}"
    assert idle_after < 2.0


async def wait_running(client: httpx.AsyncClient, at_least: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (await engine_stats(client))["num_requests_running"] < at_least:
        assert time.monotonic() < deadline, "the request never started running"
        await asyncio.sleep(0.01)


class HeldEngine:
    """The engine's steps held until `release` (each step waits in the runner), and its aborts
    recorded: so that a request cannot finish before the server has seen its client go, however
    fast the machine is (the server looks for a hung-up client every 0.25 s)."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.abort_sent = threading.Event()
        self.aborted_ids: list[str] = []
        real_execute, real_abort = engine.runner.execute, engine.abort

        def held_execute(*args: Any, **kwargs: Any) -> Any:
            assert self.release.wait(timeout=30), "the test never released the engine"
            return real_execute(*args, **kwargs)

        def recording_abort(request_id: str) -> None:
            real_abort(request_id)  # in the engine's inbox before the test can release the step
            if request_id:  # shutdown() wakes the loop with ""
                self.aborted_ids.append(request_id)
                self.abort_sent.set()

        monkeypatch.setattr(engine.runner, "execute", held_execute)
        monkeypatch.setattr(engine, "abort", recording_abort)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_non_streaming_client_that_hangs_up_is_aborted(
    server: Server, reset: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await wait_until_idle(client, timeout=5)
        aborted_before = aborted_total(await metrics_text(client))
        held = HeldEngine(server.ctx.engine.engine, monkeypatch)
        try:
            head, payload = raw_request("/v1/completions", body, server.host)
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(head + payload)
            await writer.drain()
            await wait_running(client)
            await hang_up(writer, reset)
            assert await asyncio.to_thread(held.abort_sent.wait, 10), "no abort was sent"
        finally:
            held.release.set()
        stats = await wait_until_idle(client, timeout=2.0)
        assert len(held.aborted_ids) == 1
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert aborted_total(await metrics_text(client)) == aborted_before + 1
        assert not await reader.read()  # nothing was ever sent back


@pytest.mark.timeout(60)
async def test_a_client_timeout_aborts_the_request(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is held (inside the request's first step, or before it) until the server has
    sent the abort, so the request cannot finish within the client's 0.5 s read timeout however
    fast the machine is; the abort then lands at the next step: at most the one token of the held
    step is generated (not LONG), the request is gone and every KV block is back."""
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await wait_until_idle(client, timeout=5)
        aborted_before = aborted_total(await metrics_text(client))
        before = await engine_stats(client)
        held = HeldEngine(server.ctx.engine.engine, monkeypatch)
        try:
            async with httpx.AsyncClient(
                base_url=server.url, timeout=httpx.Timeout(30, read=0.5)
            ) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post("/v1/completions", json=body)
            # The server sees the connection close and aborts the request (once).
            assert await asyncio.to_thread(held.abort_sent.wait, 10), "no abort was sent"
        finally:
            held.release.set()
        stats = await wait_until_idle(client, timeout=5.0)
        assert len(held.aborted_ids) == 1 and held.aborted_ids[0].startswith("cmpl-")
        assert (
            stats["kv_blocks_free"] == stats["kv_blocks_total"]
        )  # wait_until_idle checked the rest
        assert stats["tokens_generated"] - before["tokens_generated"] <= 1
        assert aborted_total(await metrics_text(client)) == aborted_before + 1


@pytest.mark.timeout(60)
async def test_a_client_that_hangs_up_while_queued_is_dropped_from_the_queue(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """With one running slot, a second request waits in the engine's queue; hanging up removes
    it."""
    ctx = serving_context(make_engine(tiny_model_dirs["llama"], max_num_seqs=1))
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 0}
    try:
        with live_server(create_app(ctx=ctx)) as url:
            host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 80
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                conns = []
                for _ in range(2):
                    head, payload = raw_request("/v1/completions", {**body, "stream": True}, host)
                    reader, writer = await asyncio.open_connection(host, port)
                    writer.write(head + payload)
                    await writer.drain()
                    conns.append(writer)
                deadline = time.monotonic() + 10
                while (await engine_stats(client))["num_requests_waiting"] < 1:
                    assert time.monotonic() < deadline, await engine_stats(client)
                    await asyncio.sleep(0.01)
                for writer in reversed(conns):  # the queued one first, then the running one
                    await hang_up(writer, reset=False)
                await wait_until_idle(client, timeout=2.0)
    finally:
        ctx.engine.shutdown()


@pytest.mark.timeout(60)
def test_a_consumer_whose_event_loop_is_gone_does_not_kill_the_engine(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """A request whose consumer's event loop closed without aborting it (an embedding app or a test
    that ends early): outputs for it cannot be delivered, but the engine loop must survive them,
    drop the request and keep serving everyone else."""
    ctx = serving_context(make_engine(tiny_model_dirs["llama"]))
    try:
        prompt = ctx.tokenizer("Once upon a time").input_ids
        params = DecodingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
        loop = asyncio.new_event_loop()
        orphan = ctx.engine.generate("orphan", prompt, params)
        loop.run_until_complete(orphan.__anext__())  # running: its first token arrived
        loop.close()  # the consumer is gone without closing the generator (no abort is sent)
        deadline = time.monotonic() + 3
        while ctx.engine.alive and ctx.engine.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ctx.engine.alive, f"engine loop died: {ctx.engine.error!r}"

        async def served() -> str:
            transport = httpx.ASGITransport(app=create_app(ctx=ctx), raise_app_exceptions=False)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://t", timeout=30
            ) as client:
                r = await client.post("/v1/completions", json=PROBE)
                assert r.status_code == 200, r.text
                return completion_text(r.json())

        assert asyncio.run(served())
    finally:
        ctx.engine.shutdown()


async def test_constrained_streams_cut_mid_way_free_blocks_and_matchers(server: Server) -> None:
    """Streams under a schema, a regex and a forced tool call, of every streaming shape, each cut
    after a few events: every KV block and every row's grammar matcher is gone afterwards."""
    schema = {
        "type": "object",
        "properties": {"words": {"type": "array", "items": {"type": "string"}}},
        "required": ["words"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": LONG}
    bodies = [
        ("/v1/completions", {"prompt": "Hi", "stream": True, "max_tokens": LONG,
                             "structured_outputs": {"regex": "[a-z ]{1,400}"}, "n": 2, "seed": 1}),
        ("/v1/chat/completions", {**chat, "response_format": fmt, "seed": 2}),
        ("/v1/chat/completions", {**chat, "response_format": fmt, "num_beams": 3}),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required",
                                  "max_tokens": 100}),
    ]  # fmt: skip
    cuts = [Cut("after_events", events=2, reset=reset) for reset in (False, True)]
    await asyncio.gather(*(cut_stream(server, p, b, c) for p, b in bodies for c in cuts))
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        stats = await wait_until_idle(client, timeout=5.0)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, GrammarConstraint)]
