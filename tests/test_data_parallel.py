"""Data parallelism on one host (`data_parallel_size`): copies of the model in engine processes of
their own behind one client. Each request runs whole in the least-loaded copy and answers what a
single engine answers; the KV settings are shared out, stats and gauges summed; a copy that dies
makes the server unhealthy; a copy that fails to start stops the others."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import build_serving_context, runs_engine_process
from server.cli import build_parser
from server.config import ServerConfig
from server.metrics import Metrics
from server.model.kv_budget import GiB
from server.process.replicas import ReplicatedEngine, SummedGauges, merged_stats, replica_config
from tests.conftest import TEST_DEVICE_NAME
from tests.reliability_helpers import assert_engine_dead, post_to, process_gone

pytestmark = pytest.mark.timeout(300)


def config(model_dir: Path, **changes: Any) -> ServerConfig:
    settings: dict[str, Any] = dict(
        model=str(model_dir),
        served_model_name="tiny",
        device=TEST_DEVICE_NAME,
        num_kv_blocks=256,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        linear_layout="native",  # one layout in every engine: the same rounding
        dtype="float32",
    )
    return ServerConfig(**(settings | changes))


# ---- settings -----------------------------------------------------------------------------------
def test_each_copy_gets_an_equal_share_of_the_kv_settings(tmp_path: Path) -> None:
    base = config(tmp_path, data_parallel_size=2)
    assert replica_config(base).num_kv_blocks == 128
    auto = config(tmp_path, data_parallel_size=4, num_kv_blocks=None)
    assert replica_config(auto).kv_cache_memory == GiB // 4  # auto on the CPU is 1 GiB in all
    sized = config(tmp_path, data_parallel_size=2, num_kv_blocks=None, kv_cache_memory="3GiB")
    assert replica_config(sized).kv_cache_memory == 3 * GiB // 2


def test_data_parallelism_refuses_what_it_cannot_combine_with(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_size and tensor_parallel_size"):
        config(tmp_path, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="engine_process cannot be off"):
        config(tmp_path, data_parallel_size=2, engine_process="off")
    args = build_parser().parse_args(["serve", "--data-parallel-size", "3"])
    assert args.data_parallel_size == 3
    assert runs_engine_process("auto", "cpu", 1, 2) is True
    assert runs_engine_process("auto", "cpu", 1, 1) is False


def test_stats_of_the_copies_add_up() -> None:
    one = {"steps": 3, "busy_seconds": 0.5, "max_seqs_in_step": 4, "peak_kv_blocks_used": 9}
    two = {"steps": 5, "busy_seconds": 0.25, "max_seqs_in_step": 7, "peak_kv_blocks_used": 2}
    cache_one = {"prefix_cache_queries": 10, "prefix_cache_hits": 8, "prefix_cache_hit_rate": 0.8}
    cache_two = {"prefix_cache_queries": 30, "prefix_cache_hits": 2, "prefix_cache_hit_rate": 0.07}
    merged = merged_stats(
        [one | cache_one | {"prefix_caching": True}, two | cache_two | {"prefix_caching": True}]
    )
    assert merged == {
        "steps": 8,
        "busy_seconds": 0.75,
        "max_seqs_in_step": 7,
        "peak_kv_blocks_used": 9,
        "prefix_cache_queries": 40,
        "prefix_cache_hits": 10,
        "prefix_cache_hit_rate": 0.25,  # of the summed counts, not a sum of rates
        "prefix_caching": True,
        "data_parallel_size": 2,
    }


@pytest.mark.parametrize(
    ("states", "merged"),
    [
        (["compiled", "compiled"], "compiled"),
        (["compiled", "compiling"], "compiling"),  # a benchmark waits until no copy compiles
        (["compiling", "eager"], "compiling"),
        (["eager", "compiled"], "mixed"),  # one copy's compile failed: its log says why
    ],
)
def test_the_copies_decode_steps_are_one_state(states: list[str], merged: str) -> None:
    assert merged_stats([{"decode_step": state} for state in states])["decode_step"] == merged


def gauge(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_the_copies_scheduler_gauges_are_summed() -> None:
    metrics = Metrics("m")
    gauges = SummedGauges(metrics, 2)
    first, second = gauges.for_copy(0), gauges.for_copy(1)
    first.set_cache_config(block_size=4, num_blocks=100, prefix_caching=True)
    second.set_cache_config(block_size=4, num_blocks=300, prefix_caching=True)
    first.set_scheduler_state(running=2, waiting=1, kv_cache_usage=0.5)
    second.set_scheduler_state(running=3, waiting=0, kv_cache_usage=0.1)
    second.record_preemptions(2)  # every other call reaches the shared metrics as it is
    text = metrics.render()[0].decode()
    assert gauge(text, "vllm:num_requests_running") == 5
    assert gauge(text, "vllm:num_requests_waiting") == 1
    assert gauge(text, "vllm:kv_cache_usage_perc") == pytest.approx((50 + 30) / 400)
    assert 'num_gpu_blocks="400"' in text
    assert gauge(text, "beamline:num_preemptions_total") == 2


# ---- routing, with stand-ins for the engine processes --------------------------------------------
class FakeCopy:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.stopped, self.spawned = fail, False, False

    def spawn(self) -> None:
        self.spawned = True

    def wait_ready(self) -> None:
        if self.fail:
            raise RuntimeError("no weights")

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stopped = True


def fakes(tmp_path: Path, copies: list[FakeCopy]) -> ReplicatedEngine:
    made = iter(copies)
    cfg = config(tmp_path, data_parallel_size=len(copies))
    return ReplicatedEngine(cfg, None, make_copy=lambda *_: next(made))  # type: ignore[arg-type,return-value]


def test_a_request_goes_to_the_copy_with_the_fewest_rows_in_flight(tmp_path: Path) -> None:
    engine = fakes(tmp_path, [FakeCopy(), FakeCopy()])
    beams = engine.pick(4)  # a beam search of 4 rows
    others = [engine.pick(1) for _ in range(4)]  # four greedy requests
    assert others == [1 - beams] * 4  # the beams' copy is busier until the others catch up
    assert engine.pick(1) in (0, 1)
    engine.release(beams, 4)
    assert engine.pick(1) == beams
    idle = fakes(tmp_path, [FakeCopy(), FakeCopy(), FakeCopy()])
    picks = [idle.pick(1) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]  # equally loaded copies take turns


def test_a_copy_that_fails_to_start_stops_the_others(tmp_path: Path) -> None:
    copies = [FakeCopy(), FakeCopy(fail=True), FakeCopy()]
    engine = fakes(tmp_path, copies)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.start()
    assert all(c.spawned and c.stopped for c in copies)


# ---- a server of two copies of a tiny model ------------------------------------------------------
@pytest.fixture(scope="module")
def served(llama_dir: Path) -> Iterator[dict[str, ServingContext]]:
    built = {
        "one": build_serving_context(config(llama_dir, num_kv_blocks=128)),
        "two": build_serving_context(config(llama_dir, data_parallel_size=2)),
    }
    yield built
    for ctx in built.values():
        ctx.engine.shutdown()


BODIES = [
    {"prompt": "The capital of", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon", "max_tokens": 10, "n": 2, "num_beams": 3, "temperature": 0},
    {"prompt": "Numbers: 1, 2,", "max_tokens": 9, "temperature": 0.8, "seed": 7, "n": 2},
    {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 2},
] * 2


def choices(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return [(c["text"], c["finish_reason"], c.get("logprobs")) for c in response.json()["choices"]]


async def test_two_copies_answer_what_one_engine_answers(
    served: dict[str, ServingContext],
) -> None:
    one, two = served["one"], served["two"]
    engine = two.engine
    assert isinstance(engine, ReplicatedEngine) and len(engine.copies) == 2
    pids = [copy.pid for copy in engine.copies]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    alone = [choices(await post_to(one, "/v1/completions", b)) for b in BODIES]
    together = await asyncio.gather(*(post_to(two, "/v1/completions", b) for b in BODIES))
    for expected, response in zip(alone, together, strict=True):
        got = choices(response)
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        for g, e in zip(got, expected, strict=True):
            if e[2] is not None:
                assert g[2]["tokens"] == e[2]["tokens"]
                assert g[2]["token_logprobs"] == pytest.approx(e[2]["token_logprobs"], abs=1e-5)
    # both copies served some of the concurrent requests, and every KV block is free again
    per_copy = [copy.stats() for copy in engine.copies]
    assert all(s["tokens_generated"] > 0 for s in per_copy)
    stats = engine.stats()
    assert stats["data_parallel_size"] == 2
    assert stats["kv_blocks_total"] == 256  # 128 each: the server's total shared out
    assert stats["tokens_generated"] == sum(s["tokens_generated"] for s in per_copy)
    assert two.metrics is not None
    text = two.metrics.render()[0].decode()
    assert 'num_gpu_blocks="256"' in text


async def test_a_dead_copy_makes_the_server_unhealthy(llama_dir: Path) -> None:
    ctx = build_serving_context(config(llama_dir, data_parallel_size=2))
    engine = ctx.engine
    assert isinstance(engine, ReplicatedEngine)
    victim = engine.copies[1].pid
    assert victim is not None
    transport = httpx.ASGITransport(app=create_app(ctx=ctx))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while engine.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not engine.alive
            await assert_engine_dead(client)
    finally:
        engine.shutdown()
    assert all(process_gone(copy.pid or 0) for copy in engine.copies)
