"""Async scheduling gives the same outputs as reading each step's tokens at once.

With `async_scheduling` the engine plans and queues step N+1 before it reads step N's tokens:
rows that go on hold a placeholder, the runner takes their input tokens from the device, and the
tokens are read and applied once the next forward is queued (server/engine/in_flight.py). On the
CPU the forward is synchronous, but the code path (the order of the work, placeholders, device
inputs, dropped rows) is the one a GPU runs, tested here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decoding import DecodingParams
from decoding.grammar import GrammarCompiler, GrammarSpec
from server.config import ServerConfig
from server.engine.engine import Engine
from server.engine.in_flight import PLACEHOLDER
from server.engine.request import EngineRequest
from server.engine.sampling_step import PendingChoices
from server.loading import load_engine, schedules_async
from tests.conftest import TEST_DEVICE_NAME, make_engine
from tests.engine_driver import Collected, run_to_completion, submit
from tests.test_host_syncs import PARAMS, ReadCounter
from tests.test_overlap_outputs import PROMPTS, outputs, workload


def run(engine: Engine, work: list[tuple[list[int], DecodingParams]]) -> list[Collected]:
    got = [submit(engine, str(i), prompt, params) for i, (prompt, params) in enumerate(work)]
    run_to_completion(engine)
    return got


def count_deferred(engine: Engine) -> list[int]:
    """Wraps the runner: per step, how many items took their input token from the device."""
    seen: list[int] = []
    execute = engine.runner.execute

    def counting(plan):  # type: ignore[no-untyped-def]
        deferred = plan.deferred
        seen.append(len(deferred.rows) if deferred is not None else 0)
        starts = plan.token_starts()
        for i in deferred.rows if deferred is not None else []:
            assert plan.tokens[starts[i]] == PLACEHOLDER
        return execute(plan)

    engine.runner.execute = counting  # type: ignore[method-assign]
    return seen


def engines(llama_dir: Path, **kw: object) -> tuple[Engine, Engine]:
    plain = make_engine(llama_dir, max_num_seqs=64, max_num_batched_tokens=256, **kw)  # type: ignore[arg-type]
    overlapped = make_engine(
        llama_dir,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        async_scheduling=True,
        **kw,  # type: ignore[arg-type]
    )
    return plain, overlapped


def assert_drained(*engines: Engine) -> None:
    for engine in engines:
        assert engine.pool.num_free == engine.pool.num_blocks
        assert not engine.scheduler.has_work() and not engine.output.has_pending
        assert engine._in_flight is None


@pytest.mark.parametrize("overlap_outputs", [False, True])
def test_async_outputs_equal_immediate_ones(llama_dir: Path, overlap_outputs: bool) -> None:
    """Greedy (stop strings, logprobs), seeded sampling with penalties and n, best_of, beams (their
    steps read at once) and rows a finishing token ends: what clients see is the same."""
    plain, overlapped = engines(llama_dir, overlap_outputs=overlap_outputs)
    work = workload(make_engine(llama_dir))
    tok = plain.tokenizer
    for i, text in enumerate(PROMPTS[:3]):  # a token of the free run becomes a finishing id
        prompt = tok(text).input_ids
        free = run(make_engine(llama_dir), [(prompt, DecodingParams(max_tokens=12, temperature=0))])
        finishing = (free[0].token_ids[4 + i],)
        work.append(
            (prompt, DecodingParams(max_tokens=12, temperature=0, stop_token_ids=finishing))
        )
    deferred = count_deferred(overlapped)
    expected, got = run(plain, work), run(overlapped, work)
    assert sum(deferred) > 50  # steps did take their tokens from the device
    assert [g.finish_reason for g in got[-3:]] == ["stop"] * 3
    for want, have in zip(expected, got):
        assert have.finished
        assert outputs(have) == outputs(want)
    assert_drained(plain, overlapped)
    assert overlapped.stats.tokens_generated == plain.stats.tokens_generated


def test_grammars_and_speculation_overlap_too(llama_dir: Path) -> None:
    """Constrained rows (their masks are built once the previous tokens landed) and an engine that
    speculates (rows draft only in steps that read at once) give the same tokens."""
    plain, overlapped = engines(llama_dir)
    speculating = make_engine(
        llama_dir,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        async_scheduling=True,
        speculative_tokens=8,
    )
    tok = plain.tokenizer
    compiler = GrammarCompiler(tok, len(tok), frozenset({tok.eos_token_id}))
    grammar = compiler.compile(GrammarSpec("regex", "(yes|no|maybe)( (yes|no|maybe)){2,6}!"))
    results = []
    for engine in (plain, overlapped, speculating):
        got = []
        for i, text in enumerate(PROMPTS):
            prompt = tok(text).input_ids
            params = DecodingParams(max_tokens=30, temperature=0.8, seed=i)
            constrained = Collected()
            engine.submit(
                EngineRequest(
                    f"g{i}",
                    prompt,
                    params,
                    constrained.outputs.append,
                    constraint=grammar.new_constraint(),
                )
            )
            looping = DecodingParams(max_tokens=30, temperature=0)  # drafts from its own prompt
            got += [constrained, submit(engine, f"p{i}", prompt * 3, looping)]
        run_to_completion(engine)
        results.append([outputs(g) for g in got])
    assert results[1] == results[0]
    assert results[2] == results[0]
    assert_drained(plain, overlapped, speculating)


def test_a_finishing_token_costs_one_dropped_row_and_a_length_limit_none(llama_dir: Path) -> None:
    """A row's ending by a finishing id is known only once its token is read: it ran one more
    step, dropped. Its length limit is known before: no extra row."""
    plain, overlapped = engines(llama_dir)
    prompt = plain.tokenizer(PROMPTS[2]).input_ids
    free = run(make_engine(llama_dir), [(prompt, DecodingParams(max_tokens=12, temperature=0))])
    ended = DecodingParams(max_tokens=12, temperature=0, stop_token_ids=(free[0].token_ids[6],))
    counts = []
    for engine in (plain, overlapped):
        rows_run: list[int] = []
        execute = engine.runner.execute

        def counting(plan, execute=execute, rows_run=rows_run):  # type: ignore[no-untyped-def]
            rows_run.append(plan.num_tokens)
            return execute(plan)

        engine.runner.execute = counting  # type: ignore[method-assign]
        by_id = run(engine, [(prompt, ended)])
        by_length = run(engine, [(prompt, DecodingParams(max_tokens=12, temperature=0))])
        assert by_id[0].token_ids == free[0].token_ids[:7]
        assert by_length[0].token_ids == free[0].token_ids
        counts.append(sum(rows_run))
    assert counts[1] == counts[0] + 1
    assert_drained(plain, overlapped)


def test_a_token_changed_by_a_top_k_tie_runs_the_next_step_again(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the exact redo of a tied top-k step changes a token, the step that already read the
    device's token is thrown away and planned again: outputs and blocks as without overlap."""
    plain, overlapped = engines(llama_dir)
    work = [
        (
            plain.tokenizer(p).input_ids,
            DecodingParams(max_tokens=15, temperature=0.8, top_k=20, seed=i, n=2),
        )
        for i, p in enumerate(PROMPTS)
    ]
    expected = run(plain, work)
    read = PendingChoices.read
    calls = []

    def every_third_refined(self: PendingChoices):  # type: ignore[no-untyped-def]
        choices = read(self)
        calls.append(1)
        choices.refined = len(calls) % 3 == 0
        return choices

    monkeypatch.setattr(PendingChoices, "read", every_third_refined)
    deferred = count_deferred(overlapped)
    got = run(overlapped, work)
    assert [outputs(g) for g in got] == [outputs(w) for w in expected]
    assert len(deferred) > len(calls) * 1.2  # steps ran again
    assert_drained(overlapped)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_the_step_reads_once_after_the_next_forward_is_queued(llama_dir: Path, kind: str) -> None:
    engine = make_engine(llama_dir, async_scheduling=True)
    params = PARAMS[kind]  # greedy; sampled with top-k, top-p, min-p and penalties
    for i in range(3):
        submit(engine, str(i), [5, 9, 13, 17 + i], params)
    for _ in range(3):
        engine.step()
    events: list[str] = []
    execute = engine.runner.execute

    def queued(plan):  # type: ignore[no-untyped-def]
        events.append("forward")
        return execute(plan)

    engine.runner.execute = queued  # type: ignore[method-assign]
    for _ in range(5):
        events.clear()
        counter = ReadCounter()
        with counter:
            assert engine.step()
        assert sum(counter.reads.values()) <= 1, dict(counter.reads)
        assert events == ["forward"]
        assert engine._in_flight is not None  # this step's tokens: read during the next one


def test_an_abort_with_tokens_in_flight_ends_the_request_once(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, async_scheduling=True)
    prompt = engine.tokenizer(PROMPTS[1]).input_ids
    free = run(make_engine(llama_dir), [(prompt, DecodingParams(max_tokens=50, temperature=0))])
    got = submit(engine, "r", prompt, DecodingParams(max_tokens=50, temperature=0.0))
    other = submit(engine, "o", prompt, DecodingParams(max_tokens=20, temperature=0.0))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort("r")
    run_to_completion(engine)
    assert [o.request_done for o in got.outputs].count(True) == 1
    assert got.outputs[-1].finish_reason == "abort"
    assert 0 < len(got.token_ids) < 50  # what it streamed: real tokens, never a placeholder
    assert got.token_ids == free[0].token_ids[: len(got.token_ids)]
    assert other.finish_reason == "length" and len(other.token_ids) == 20
    assert_drained(engine)


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False)],
)
def test_async_setting(setting: str, device: str, expected: bool) -> None:
    assert schedules_async(setting, device) is expected


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_setting_reaches_the_engine_a_server_builds(llama_dir: Path, setting: str) -> None:
    config = ServerConfig(
        model=str(llama_dir), device=TEST_DEVICE_NAME, num_kv_blocks=64, async_scheduling=setting
    )  # type: ignore[arg-type]
    assert load_engine(config).engine.async_scheduling is (setting == "on")


def test_a_read_that_fails_ends_the_requests_in_flight_and_the_engine_goes_on(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the request that goes on and one at its length limit (no placeholder, not in the next
    step) end with an error; nothing hangs, every block comes back, later requests are served."""
    engine = make_engine(llama_dir, async_scheduling=True)
    prompt = engine.tokenizer(PROMPTS[0]).input_ids
    going_on = submit(engine, "on", prompt, DecodingParams(max_tokens=20, temperature=0))
    at_limit = submit(engine, "last", prompt, DecodingParams(max_tokens=1, temperature=0))
    engine.step()  # prefill, first tokens in flight
    assert engine._in_flight is not None
    read = PendingChoices.read

    def broken(self: PendingChoices):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(PendingChoices, "read", read)  # once
        raise RuntimeError("device lost")

    monkeypatch.setattr(PendingChoices, "read", broken)
    run_to_completion(engine)
    for got in (going_on, at_limit):
        assert got.finish_reason == "error" and got.finished
    assert_drained(engine)
    later = submit(engine, "later", prompt, DecodingParams(max_tokens=5, temperature=0))
    run_to_completion(engine)
    assert later.finish_reason == "length" and len(later.token_ids) == 5
