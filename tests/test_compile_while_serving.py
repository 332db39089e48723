"""The decode step compiled while the server answers (`compile_while_serving`, on by default with
`torch_compile` on the CPU): requests run on the eager step while a process of its own compiles,
the compiled step takes over between two steps with no request lost or changed, and a later start
reads the step from the cache without starting a compile."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from decoding import DecodingParams
from server.config import ServerConfig
from server.engine.engine import Engine
from server.model import background_compile
from server.model.background_compile import BackgroundCompile, ForwardClock
from server.model.compile_cache import entry_lock
from server.model.runner import ModelRunner
from server.runner_setup import build_runner
from tests.conftest import make_engine
from tests.engine_driver import Collected, Counted, generate, submit

# greedy, beam search and seeded sampling (float32: the compiled step's tokens are the eager one's)
REQUESTS = {
    "greedy": DecodingParams(max_tokens=12, temperature=0, ignore_eos=True),
    "beams": DecodingParams(max_tokens=12, n=3, num_beams=3, ignore_eos=True),
    "sampled": DecodingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
}
PROMPTS = [[2, 15, 27, 31, 8], [2, 40, 41]]
WAIT_S = 600  # the compile process: a tiny model's two graphs take under a minute here


def runner_of(model_dir: Path, cache: Path, **settings: object) -> ModelRunner:
    config = ServerConfig(
        model=str(model_dir),
        dtype="float32",
        torch_compile=True,
        cache_dir=cache,
        num_kv_blocks=256,
        block_size=4,
        **settings,  # type: ignore[arg-type]
    )
    return build_runner(config, model_dir, torch.device("cpu"))


def engine_of(runner: ModelRunner, model_dir: Path) -> Engine:
    return Engine(runner, make_engine(model_dir).tokenizer, max_num_batched_tokens=16)


def answers(engine: Engine) -> dict[str, list[dict[int, tuple[str, list[int], str | None]]]]:
    return {
        name: [got.choices() for got in generate(engine, PROMPTS, params)]
        for name, params in REQUESTS.items()
    }


def run_until_done(engine: Engine, got: list[Collected], steps: int = 10_000) -> None:
    for _ in range(steps):
        if all(g.finished for g in got):
            return
        engine.step()
    raise AssertionError("the requests did not finish")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-while-serving")


@pytest.fixture(autouse=True)
def not_niced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile process at the tests' own priority: niced, the other test worker's tests
    starve it (minutes, where it takes seconds alone)."""
    monkeypatch.setattr(background_compile, "NICENESS", 0)


def test_requests_are_answered_while_the_step_compiles_and_the_switch_changes_no_token(
    tiny_model_dirs: dict[str, Path], cache: Path
) -> None:
    model_dir = tiny_model_dirs["gemma3"]
    runner = runner_of(model_dir, cache)
    steps, job = runner.compiled_decode, runner.decode_step.job
    assert steps is not None and job is not None and not steps.cached
    engine = engine_of(runner, model_dir)
    # the compile process waits for this lock (as a second server would): the requests below
    # are answered, for certain, before any compiled step exists
    with entry_lock(steps.base.directory):  # type: ignore[arg-type]
        runner.warm_up()
        eager = answers(engine)
        assert runner.decode_step.state == "compiling" and not job.done
        assert engine.stats_snapshot()["decode_step"] == "compiling"
        # a request in flight across the switch
        long = DecodingParams(max_tokens=40, temperature=0, ignore_eos=True)
        crossing = submit(engine, "crossing", PROMPTS[0], long)
        for _ in range(10):
            engine.step()
        assert 0 < len(crossing.token_ids) < 40
    assert job.wait(WAIT_S), "the compile process did not finish"
    run_until_done(engine, [crossing])
    assert runner.decode_step.state == "compiled" and steps.sources == ["loaded"]
    counted = Counted(runner.decode_step.run)
    runner.decode_step.run = counted
    assert answers(engine) == eager
    assert counted.calls >= 10  # the decode steps above ran the compiled step
    solo = generate(engine_of(runner_of(model_dir, cache), model_dir), [PROMPTS[0]], long)
    assert crossing.token_ids == solo[0].token_ids
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_later_start_reads_the_cached_step_without_a_compile_process(
    tiny_model_dirs: dict[str, Path], cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_model_dirs["gemma3"]
    runner = runner_of(model_dir, cache)
    steps, job = runner.compiled_decode, runner.decode_step.job
    assert steps is not None and job is not None and steps.cached  # the test above's entry
    with caplog.at_level(logging.INFO, logger="server.model.background_compile"):
        runner.warm_up()
        assert job.wait(WAIT_S)
        assert runner.decode_step.between_steps()
    said = [r.getMessage() for r in caplog.records]
    assert not any("background process" in line for line in said), said
    assert any("read from the cache" in line for line in said), said
    assert job.process is None and runner.decode_step.state == "compiled"
    assert steps.sources == ["loaded"]


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (1, "the compile process ended with exit code 1"),
        (3, "does not compile ahead of time"),
        (-15, "the compile process was stopped by signal 15"),  # SIGTERM to the server's group
    ],
)
def test_a_failed_compile_leaves_the_eager_step_serving(
    tiny_model_dirs: dict[str, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    said: str,
) -> None:
    model_dir = tiny_model_dirs["llama"]
    runner = runner_of(model_dir, tmp_path)
    job = runner.decode_step.job
    assert job is not None
    monkeypatch.setattr(background_compile, "WORKER", "tests.stand_in_worker")
    job.worker_spec = str(code)  # the stand-in exits with it
    engine = engine_of(runner, model_dir)
    runner.warm_up()
    assert job.wait(WAIT_S)
    with caplog.at_level(logging.WARNING, logger="server.model.background_compile"):
        got = generate(engine, PROMPTS, REQUESTS["greedy"])
    assert all(g.finished and len(g.token_ids) == 12 for g in got)
    assert runner.decode_step.state == "eager" and runner.decode_step.job is None
    assert engine.stats_snapshot()["decode_step"] == "eager"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "stays eager" in warned[0] and said in warned[0], warned


def test_with_lora_slots_both_compiled_steps_come_while_serving(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A server with LoRA slots compiles the base step and the adapter step (compiled_steps.py)
    in the compile process; both are adopted together, and base requests keep their tokens."""
    model_dir = tiny_model_dirs["llama"]
    runner = runner_of(model_dir, tmp_path, enable_lora=True, max_loras=2, max_lora_rank=8)
    steps, job = runner.compiled_decode, runner.decode_step.job
    assert steps is not None and steps.adapters is not None and job is not None
    engine = engine_of(runner, model_dir)
    runner.warm_up()
    eager = answers(engine)
    assert job.wait(WAIT_S), "the compile process did not finish"
    assert runner.decode_step.between_steps()
    assert steps.sources == ["loaded", "loaded"]
    assert runner.lora is not None and runner.lora.state.step is None  # the examples' cleared
    assert answers(engine) == eager


class CachedSteps:
    """A stand-in for CompiledSteps whose graphs are in the cache: it notes when they are read."""

    cached = True
    base = SimpleNamespace(directory="cache")

    def __init__(self) -> None:
        self.read_at: list[float] = []

    def read_cached(self) -> list[list[Any]]:
        self.read_at.append(time.monotonic())
        return [["graph"]]


def test_the_cached_step_is_read_once_no_forward_has_run_for_a_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading holds the GIL for seconds: a request's steps would wait for all of it."""
    monkeypatch.setattr(background_compile, "QUIET_S", 0.3)
    clock, steps, job = ForwardClock(), CachedSteps(), BackgroundCompile("")
    with clock.forward():
        job.start(steps, clock.quiet_for)  # type: ignore[arg-type]
        time.sleep(0.6)
        assert not steps.read_at and not job.done  # a forward runs
    ended = time.monotonic()
    with clock.forward():  # a second forward soon after: the moment starts again
        time.sleep(0.1)
    assert job.wait(10) and job.failure is None
    assert steps.read_at[0] - ended >= 0.1 + 0.3


@pytest.mark.parametrize("cached", [True, False])
def test_a_start_compiles_or_reads_the_step_a_moment_after_it_is_ready_at_the_soonest(
    monkeypatch: pytest.MonkeyPatch, cached: bool
) -> None:
    """A first client sends its request once /health says ready: it is answered before the
    compile process starts (it takes a core) or the cached step is read (it takes the GIL)."""
    monkeypatch.setattr(background_compile, "QUIET_S", 0.3)
    clock, steps, job = ForwardClock(), CachedSteps(), BackgroundCompile("")
    steps.cached = cached
    compiled_at: list[float] = []
    monkeypatch.setattr(job, "_compile_elsewhere", lambda: compiled_at.append(time.monotonic()))
    time.sleep(0.4)  # loading, after the runner was built: no forward yet
    started = time.monotonic()
    job.start(steps, clock.quiet_for)  # type: ignore[arg-type]
    assert job.wait(10)
    assert steps.read_at[0] - started >= 0.3
    if not cached:
        assert compiled_at[0] - started >= 0.3
        assert steps.read_at[0] - compiled_at[0] >= 0.3  # and quiet again before the read


def test_the_cached_step_is_read_at_the_latest_half_a_minute_in_under_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(background_compile, "AT_THE_LATEST_S", 0.4)
    clock, steps, job = ForwardClock(), CachedSteps(), BackgroundCompile("")
    with clock.forward():  # never quiet
        started = time.monotonic()
        job.start(steps, clock.quiet_for)  # type: ignore[arg-type]
        assert job.wait(10) and job.failure is None
    assert steps.read_at[0] - started >= 0.4
