"""The serving benchmark's metric math, and its client against a fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmarks import accuracy, serve
from benchmarks.client import (
    CompletionTarget,
    make_client,
    poisson_arrivals,
    run_concurrency,
    run_poisson,
    stream_completion,
)
from benchmarks.launch import beamline_command
from benchmarks.serving import vllm_cpu
from benchmarks.serving.beam_case import run_beam_case
from benchmarks.serving.hf_baseline import load_hf_model, own_length, run_static_batches
from benchmarks.serving.options import peers_comparable
from benchmarks.serving.report import Run, SystemResult, ratio_rows
from benchmarks.serving.structured import format_structured, histogram_quantile, run_structured
from benchmarks.serving.systems import dtype_args
from benchmarks.stats import RequestResult, distribution_ms, percentile, summarize
from benchmarks.workload import (
    BenchRequest,
    load_prompts,
    prompts_workload,
    synthetic_workload,
    with_shared_prefix,
)
from server.api.app import create_app
from server.api.serving import ServingContext
from server.model.quantization import RESCORED_CANDIDATES
from tests.live_server import live_server

TOKEN_DELAY_S = 0.002


# ---- a fake OpenAI-compatible streaming server ---------------------------------------------------
def fake_openai_app(
    *, send_usage: bool = True, with_stats: bool = False, api_key: str | None = None
) -> FastAPI:
    """Streams one chunk per token, then an empty finish chunk (as llama-server does), then usage.

    Prompt "FAIL" gets HTTP 500; prompt "BROKEN" gets an error payload in the middle of the stream.
    """
    app = FastAPI()
    stats = {"kv_blocks_total": 100, "kv_blocks_free": 100, "peak_kv_blocks_used": 0}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    if with_stats:

        @app.get("/v1/engine/stats")
        async def engine_stats() -> dict:
            return stats

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request):
        body = await request.json()
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse(
                {"error": {"message": "bad key", "type": "authentication_error"}}, status_code=401
            )
        if body["prompt"] == "FAIL":
            return JSONResponse(
                {"error": {"message": "boom", "type": "server_error"}}, status_code=500
            )
        n = int(body["max_tokens"])
        beams = int(body.get("num_beams", 1))

        def sse(obj: object) -> str:
            return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"

        async def events() -> AsyncIterator[str]:
            stats["kv_blocks_free"] = 100 - 2 * beams
            stats["peak_kv_blocks_used"] = max(stats["peak_kv_blocks_used"], 2 * beams)
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S * beams)
                if body["prompt"] == "BROKEN" and i == 1:
                    yield sse({"error": {"message": "engine died"}})
                    return
                yield sse({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]})
            stats["kv_blocks_free"] = 100
            yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if send_usage and (body.get("stream_options") or {}).get("include_usage"):
                yield sse(
                    {
                        "choices": [],
                        "usage": {
                            "prompt_tokens": len(body["prompt"].split()),
                            "completion_tokens": n,
                            "total_tokens": 0,
                        },
                    }
                )
            yield sse("[DONE]")

        if not body.get("stream"):
            async for _ in events():
                pass
            return {
                "choices": [{"index": 0, "text": "t " * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": n},
            }
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        """Streams one delta per token; counts the requests it got in `chat_requests`."""
        body = await request.json()
        chat_requests.append(body["messages"][-1]["content"])
        n = int(body["max_tokens"])

        async def events() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(delta)}\n\n"
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    chat_requests: list[str] = []
    app.state.chat_requests = chat_requests
    return app


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with live_server(fake_openai_app()) as url:
        yield url


# ---- stats ---------------------------------------------------------------------------------------
def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [10.0, 1.0, 4.0, 3.0, 2.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)  # position 3.6
    assert percentile(values, 99) == pytest.approx(4 + 0.96 * 6)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_distribution_is_in_ms_and_none_without_data() -> None:
    d = distribution_ms([0.001, 0.003])
    assert d["mean"] == pytest.approx(2.0) and d["p50"] == pytest.approx(2.0)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    r = RequestResult(success=True, ttft=0.2, e2el=1.1, output_tokens=10)
    assert r.tpot == pytest.approx(0.1)
    assert RequestResult(success=True, ttft=0.2, e2el=0.2, output_tokens=1).tpot is None
    assert RequestResult(success=False, ttft=0.2, e2el=1.0, output_tokens=5).tpot is None


def test_summarize_pools_itl_and_counts_only_successes() -> None:
    a = RequestResult(
        index=0,
        success=True,
        ttft=0.1,
        e2el=0.4,
        itl=[0.1, 0.2],
        output_tokens=3,
        prompt_tokens=5,
        expected_output_tokens=3,
    )
    b = RequestResult(
        index=1,
        success=True,
        ttft=0.3,
        e2el=0.6,
        itl=[0.3],
        output_tokens=2,
        prompt_tokens=7,
        expected_output_tokens=4,
    )
    bad = RequestResult(index=2, success=False, error="HTTP 500: boom", e2el=0.01)
    m = summarize([a, b, bad], duration_s=2.0)
    assert (m["completed"], m["errors"], m["error_examples"]) == (2, 1, ["HTTP 500: boom"])
    assert m["output_length_mismatches"] == 1
    assert m["total_output_tokens"] == 5 and m["total_input_tokens"] == 12
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(8.5)
    assert m["itl_ms"]["mean"] == pytest.approx(200.0) and m["itl_ms"]["p50"] == pytest.approx(
        200.0
    )
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT: a -> (0.4 - 0.1) / 2 = 0.15, b -> (0.6 - 0.3) / 1 = 0.3
    assert m["tpot_ms"]["mean"] == pytest.approx(225.0)
    assert m["e2el_ms"]["p50"] == pytest.approx(500.0)
    json.dumps(m, allow_nan=False)
    assert summarize([], 0.0)["output_throughput"] == 0.0


def test_ratios_are_oriented_so_above_one_means_ours_is_better() -> None:
    def metrics(tps: float, ttft: float, e2el: float) -> dict:
        return {
            "completed": 1,
            "output_throughput": tps,
            "request_throughput": tps / 10,
            "ttft_ms": {"p50": ttft},
            "e2el_ms": {"mean": e2el},
        }

    ours = SystemResult(
        "ours", "ours", "server", [Run(1, metrics(20, 50, 100)), Run(4, metrics(60, 80, 200))]
    )
    static = SystemResult("static", "s", "static-batching", [Run(4, metrics(30, 160, 800))])
    seq = SystemResult("seq", "q", "sequential", [Run(1, metrics(10, 100, 400))])
    rows = {(r["x"], r["baseline"]): r for r in ratio_rows(ours, [static, seq])}
    assert set(rows) == {(1, "seq"), (4, "static"), (4, "seq")}
    assert rows[(4, "static")]["output_throughput_ratio"] == pytest.approx(2.0)
    assert rows[(4, "static")]["ttft_p50_ratio"] == pytest.approx(2.0)
    assert rows[(4, "static")]["e2el_mean_ratio"] == pytest.approx(4.0)
    assert rows[(1, "seq")]["output_throughput_ratio"] == pytest.approx(2.0)


def test_static_batch_counts_only_each_requests_own_tokens() -> None:
    assert own_length([5, 6, 1, 7, 8], 4, eos_ids=(1,), ignore_eos=True) == 4
    assert own_length([5, 6, 1, 7, 8], 4, eos_ids=(1,), ignore_eos=False) == 3
    assert own_length([5, 6, 7], 8, eos_ids=(1,), ignore_eos=False) == 3


# ---- workloads -----------------------------------------------------------------------------------
def test_synthetic_workload_is_seeded_and_within_ranges() -> None:
    w = synthetic_workload(48, (8, 48), (32, 128), seed=3)
    assert w == synthetic_workload(48, (8, 48), (32, 128), seed=3)
    assert w.requests != synthetic_workload(48, (8, 48), (32, 128), seed=4).requests
    assert len(w.requests) == 48
    assert all(8 <= len(r.prompt.split()) <= 48 and 32 <= r.max_tokens <= 128 for r in w.requests)
    assert w.describe()["output_tokens_total"] == sum(r.max_tokens for r in w.requests)
    with pytest.raises(ValueError):
        synthetic_workload(4, (8, 4), (1, 2))


def test_shared_prefix_workload_prepends_one_seeded_system_prompt() -> None:
    base = synthetic_workload(6, (8, 12), (4, 8), seed=1)
    w = with_shared_prefix(base, 200, seed=1)
    prefix = w.requests[0].prompt[: -len(base.requests[0].prompt)]
    assert len(prefix.split()) == 200 and prefix.endswith(".\n\n")
    assert [r.prompt for r in w.requests] == [prefix + r.prompt for r in base.requests]
    assert [r.max_tokens for r in w.requests] == [r.max_tokens for r in base.requests]
    assert w == with_shared_prefix(base, 200, seed=1)  # seeded
    assert with_shared_prefix(base, 200, seed=2).requests[0].prompt != w.requests[0].prompt
    assert w.describe()["shared_prefix_words"] == 200
    assert w.describe()["prompt_words_total"] == base.describe()["prompt_words_total"] + 6 * 200
    assert with_shared_prefix(base, 0) == base
    with pytest.raises(ValueError):
        with_shared_prefix(base, -1)
    args = serve.resolve_args(
        ["--launch-beamline", "--short", "--shared-prefix-words", "30", "--seed", "1"]
    )
    assert serve.build_workload(args) == with_shared_prefix(
        synthetic_workload(8, (8, 48), args.output_tokens, seed=1), 30, seed=1
    )
    assert not peers_comparable(
        serve.resolve_args(["--launch-beamline", "--shared-prefix-words", "30"])
    )
    assert peers_comparable(serve.resolve_args(["--launch-beamline"]))


def test_grounded_workload_quotes_a_passage_in_every_chat_request() -> None:
    from benchmarks.workload import PASSAGES, grounded_workload

    a, b = grounded_workload(9, (8, 16), seed=3), grounded_workload(9, (8, 16), seed=3)
    assert a == b and a.chat and a.describe()["chat"]
    paragraphs = [" ".join(p.split()) for p in PASSAGES.read_text().split("\n\n") if p.strip()]
    for i, req in enumerate(a.requests):
        assert any(p in req.prompt for p in paragraphs)
        assert req.prompt.startswith(("Repeat", "Rewrite", "Copy")[i % 3])
        assert 8 <= req.max_tokens <= 16


def test_bundled_prompt_set() -> None:
    prompts = load_prompts()
    assert 40 <= len(prompts) <= 60 and len(set(prompts)) == len(prompts)
    w = prompts_workload(60, (16, 32), seed=0)
    assert len(w.requests) == 60 and {r.prompt for r in w.requests} == set(prompts)


# ---- the client against the fake server ----------------------------------------------------------
def test_streamed_request_counts_tokens_and_times_them(fake_url: str) -> None:
    async def go() -> RequestResult:
        async with make_client(1, 30) as client:
            return await stream_completion(
                client,
                CompletionTarget(fake_url, "fake-model"),
                BenchRequest(0, "one two three", 6),
            )

    r = asyncio.run(go())
    assert r.success and r.error == ""
    assert r.output_tokens == 6 and r.prompt_tokens == 3
    assert len(r.itl) == 5  # gaps between the 6 text chunks; the empty finish chunk doesn't count
    assert 0 < r.ttft <= r.e2el
    assert sum(r.itl) <= r.e2el - r.ttft + 1e-9
    assert r.text == "t0 t1 t2 t3 t4 t5 "


def test_without_usage_the_token_count_is_the_number_of_text_chunks() -> None:
    async def go(url: str) -> RequestResult:
        async with make_client(1, 30) as client:
            return await stream_completion(
                client, CompletionTarget(url, "m", ignore_eos=False), BenchRequest(0, "x", 4)
            )

    with live_server(fake_openai_app(send_usage=False)) as url:
        r = asyncio.run(go(url))
    assert r.success and r.output_tokens == 4 and r.expected_output_tokens is None


def test_http_500_and_stream_errors_are_counted_not_raised(fake_url: str) -> None:
    reqs = [
        BenchRequest(0, "fine", 3),
        BenchRequest(1, "FAIL", 3),
        BenchRequest(2, "BROKEN", 3),
        BenchRequest(3, "fine too", 3),
    ]
    results, duration = asyncio.run(
        run_concurrency(CompletionTarget(fake_url, "fake-model"), reqs, 2)
    )
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.success for r in results] == [True, False, False, True]
    assert "HTTP 500" in results[1].error and "boom" in results[1].error
    assert "engine died" in results[2].error
    m = summarize(results, duration)
    assert m["errors"] == 2 and m["completed"] == 2 and m["total_output_tokens"] == 6


def test_api_key_is_sent_as_bearer_token() -> None:
    async def go(url: str, key: str | None) -> RequestResult:
        async with make_client(1, 30, key) as client:
            return await stream_completion(
                client, CompletionTarget(url, "m"), BenchRequest(0, "x", 2)
            )

    with live_server(fake_openai_app(api_key="sekrit")) as url:
        assert asyncio.run(go(url, "sekrit")).success
        denied = asyncio.run(go(url, None))
    assert not denied.success and "HTTP 401" in denied.error


def test_unreachable_server_is_an_error_result() -> None:
    async def go() -> RequestResult:
        async with make_client(1, 5) as client:
            return await stream_completion(
                client, CompletionTarget("http://127.0.0.1:9", "m"), BenchRequest(0, "x", 2)
            )

    r = asyncio.run(go())
    assert not r.success and r.error


def test_poisson_arrivals_are_seeded_and_run(fake_url: str) -> None:
    a = poisson_arrivals(20, rate=50.0, seed=1)
    assert a == poisson_arrivals(20, rate=50.0, seed=1) and a != poisson_arrivals(
        20, rate=50.0, seed=2
    )
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    with pytest.raises(ValueError):
        poisson_arrivals(3, rate=0, seed=0)
    reqs = [BenchRequest(i, f"p {i}", 3) for i in range(6)]
    results, _ = asyncio.run(
        run_poisson(CompletionTarget(fake_url, "fake-model"), reqs, 200.0, 0, max_concurrency=2)
    )
    assert all(r.success and r.output_tokens == 3 for r in results)


def test_cli_writes_json_and_png_against_any_server(fake_url: str, tmp_path: Path, capsys) -> None:
    code = serve.main(
        [
            "--base-url",
            fake_url,
            "--baselines",
            "none",
            "--num-requests",
            "6",
            "--output-tokens",
            "2,5",
            "--concurrency",
            "1,3",
            "--out-dir",
            str(tmp_path),
            "--tag",
            "run",
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert {
        "workload",
        "systems",
        "ratios",
        "recorded_peers",
        "skipped",
        "machine",
        "server",
        "mode",
        "plot",
    } <= set(doc)
    assert doc["server"]["model_name"] == "fake-model"
    runs = doc["systems"]["server"]["runs"]
    assert [r["x"] for r in runs] == [1, 3]
    for run in runs:
        m = run["metrics"]
        assert m["completed"] == 6 and m["errors"] == 0 and m["output_length_mismatches"] == 0
        assert m["total_output_tokens"] == doc["workload"]["output_tokens_total"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(m[key]) == {"mean", "p50", "p90", "p99"}
        assert m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
    assert all(p["note"] == "recorded, not measured in this run" for p in doc["recorded_peers"])
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "recorded, not measured in this run" in out and "out tok/s" in out


def test_cli_exit_code_reports_request_errors(tmp_path: Path) -> None:
    with live_server(fake_openai_app()) as url:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "FAIL"}\n{"prompt": "ok"}\n')
        code = serve.main(
            [
                "--base-url",
                url,
                "--baselines",
                "none",
                "--dataset",
                "prompts",
                "--prompts-file",
                str(prompts),
                "--num-requests",
                "2",
                "--output-tokens",
                "2,2",
                "--concurrency",
                "2",
                "--warmup",
                "0",
                "--out-dir",
                str(tmp_path),
                "--tag",
                "e",
            ]
        )
    assert code == 1
    assert (
        json.loads((tmp_path / "e.json").read_text())["systems"]["server"]["runs"][0]["metrics"][
            "errors"
        ]
        == 1
    )


# ---- beam case -----------------------------------------------------------------------------------
def test_beam_case_without_engine_stats_still_times(fake_url: str) -> None:
    res = asyncio.run(run_beam_case(fake_url, "fake-model", max_tokens=5))
    assert res["greedy"]["status"] == 200 and res["beam"]["status"] == 200
    assert res["beam"]["request"]["num_beams"] == 4 and res["beam"]["request"]["temperature"] == 0
    assert res["time_ratio"] is not None and res["time_ratio"] > 1
    assert not res["engine_stats_available"] and res["kv_blocks_ratio"] is None


def test_beam_case_reads_kv_blocks_when_available(tmp_path: Path) -> None:
    with live_server(fake_openai_app(with_stats=True)) as url:
        res = asyncio.run(run_beam_case(url, "fake-model", max_tokens=20))
        code = serve.main(
            [
                "--base-url",
                url,
                "--beam-case",
                "--beam-max-tokens",
                "4",
                "--out-dir",
                str(tmp_path),
                "--tag",
                "beam",
            ]
        )
    assert res["engine_stats_available"]
    assert (
        res["greedy"]["kv_blocks_used_peak_sampled"] == 2
        and res["beam"]["kv_blocks_used_peak_sampled"] == 8
    )
    assert res["kv_blocks_ratio"] == pytest.approx(4.0)
    assert code == 0 and "beam_case" in json.loads((tmp_path / "beam.json").read_text())


def test_launch_command_binds_loopback() -> None:
    cmd = beamline_command(1234, "m.gguf", ["--dtype", "float32"])
    assert cmd[1:4] == ["-m", "server.cli", "serve"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[-2:] == ["--dtype", "float32"]


# ---- HF baseline on a tiny model -----------------------------------------------------------------
def test_hf_static_batching_times_each_request_and_pads_to_the_longest(llama_dir: Path) -> None:
    hf = load_hf_model(str(llama_dir), "float32")
    reqs = [
        BenchRequest(0, "Hello world", 3),
        BenchRequest(1, "The quick brown fox jumps", 7),
        BenchRequest(2, "Once upon a time", 5),
    ]
    results, duration = run_static_batches(hf, reqs, batch_size=2)
    assert [r.output_tokens for r in results] == [3, 7, 5]  # own tokens only, not the batch's 7
    assert [len(r.itl) for r in results] == [2, 6, 4]
    first, second = results[0], results[1]
    assert first.e2el == second.e2el  # a static batch answers everyone when its longest member ends
    assert all(0 < r.ttft <= r.e2el <= duration for r in results)
    assert results[0].prompt_tokens < results[1].prompt_tokens
    seq, _ = run_static_batches(hf, reqs[:1], batch_size=1)
    assert seq[0].text == results[0].text  # left padding doesn't change greedy output


def test_compare_beamline_takes_label_equals_flags_and_needs_a_launched_server() -> None:
    args = serve.resolve_args(
        [
            "--launch-beamline",
            "--compare-beamline",
            "int8=--quantization int8",
            "--compare-beamline",
            "plain=",
        ]
    )
    assert args.variants == [("int8", "--quantization int8"), ("plain", "")]
    with pytest.raises(SystemExit):
        serve.resolve_args(["--launch-beamline", "--compare-beamline", "no-equals-sign"])
    with pytest.raises(SystemExit):
        serve.resolve_args(
            ["--base-url", "http://127.0.0.1:1", "--compare-beamline", "x=--dtype float32"]
        )


def test_a_compared_beamline_is_matched_level_by_level() -> None:
    def system(name: str, kind: str, tps: list[float]) -> SystemResult:
        runs = [Run(x, {"completed": 4, "output_throughput": t}) for x, t in zip((1, 16), tps)]
        return SystemResult(name, name, kind, runs)

    ours = system("beamline", "server", [20.0, 120.0])
    before = system("before", "server-variant", [10.0, 40.0])
    rows = ratio_rows(ours, [before])
    assert [(r["x"], r["output_throughput_ratio"]) for r in rows] == [(1, 2.0), (16, 3.0)]


def test_histogram_quantile_reads_the_bucket_bound() -> None:
    text = (
        'beamline:grammar_compile_seconds_bucket{le="0.001",model_name="m"} 2.0\n'
        'beamline:grammar_compile_seconds_bucket{le="0.01",model_name="m"} 9.0\n'
        'beamline:grammar_compile_seconds_bucket{le="+Inf",model_name="m"} 10.0\n'
    )
    name = "beamline:grammar_compile_seconds"
    assert histogram_quantile(text, name, 0.5) == 0.01
    assert histogram_quantile(text, name, 0.2) == 0.001
    assert histogram_quantile(text, name, 0.99) == float("inf")
    assert histogram_quantile("", name, 0.5) is None


def test_structured_workload_against_a_live_beamline(tiny_ctx: ServingContext) -> None:
    with live_server(create_app(ctx=tiny_ctx)) as url:
        report = asyncio.run(run_structured(url, "tiny", [8]))
    [run] = report["runs"]
    assert run["errors"] == [0, 0]
    assert run["output_tokens"][0] == run["output_tokens"][1]  # same lengths, unconstrained
    assert run["valid"] >= 45  # a random tiny model: a few hit max_tokens inside a string
    assert run["mask_steps"] > 0 and run["mask_ms_per_step"] > 0
    assert 0 < report["compile_s_p50_bucket"] <= report["compile_s_p99_bucket"]
    assert "structured workload: 52 JSON schemas" in format_structured(report)


def test_launch_stops_waiting_when_the_model_failed_to_load() -> None:
    """/health answers 503 while loading and after a failed load alike; the message tells them
    apart, so a launched server that cannot load fails the run at once, not after its timeout."""
    import time

    from benchmarks.launch import LaunchError, wait_healthy

    def broken() -> ServingContext:
        raise ValueError("no tokenizer decoder")

    with live_server(create_app(loader=broken)) as url:
        start = time.monotonic()
        with pytest.raises(LaunchError, match="model failed to load: no tokenizer decoder"):
            wait_healthy(url, timeout_s=60)
        assert time.monotonic() - start < 10


def test_a_compared_beamline_that_cannot_start_is_skipped_and_the_run_goes_on(
    llama_dir: Path, tmp_path: Path
) -> None:
    """The main server's results are in the JSON before the broken variant is tried; the variant
    is listed under `skipped` with its reason, the baseline after it still runs, and the run's
    JSON says it completed (exit code 2: a beamline did not start)."""
    code = serve.main(
        ["--launch-beamline", "--model", str(llama_dir), "--dtype", "float32"]
        + ["--compare-beamline", "broken=--no-such-flag", "--baselines", "hf-static"]
        + ["--num-requests", "2", "--output-tokens", "2,3", "--concurrency", "2"]
        + ["--warmup", "0", "--launch-timeout", "120", "--out-dir", str(tmp_path)]
        + ["--tag", "run"]
    )
    assert code == 2
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["complete"] is True
    assert list(doc["systems"]) == ["beamline", "hf-static"]
    assert doc["systems"]["beamline"]["runs"][0]["metrics"]["completed"] == 2
    assert "--no-such-flag" in doc["skipped"]["broken"]
    assert "beamline-broken.log" in doc["skipped"]["broken"]  # the server's last lines: why
    assert [r["baseline"] for r in doc["ratios"]] == ["hf-static"]
    assert not list(tmp_path.glob(".*.tmp"))  # every write replaced the file whole


def test_a_launched_beamline_gets_a_dtype_only_when_one_is_given() -> None:
    args = serve.resolve_args(["--launch-beamline"])
    assert dtype_args(args) == [] and args.hf_dtype == "float32"  # beamline's own default
    args = serve.resolve_args(["--launch-beamline", "--dtype", "bfloat16"])
    assert dtype_args(args) == ["--dtype", "bfloat16"] and args.hf_dtype == "bfloat16"


def test_vllm_cpu_starts_as_a_module_with_its_cpu_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    args = serve.resolve_args(["--launch-beamline", "--baselines", "vllm-cpu"])
    assert args.baseline_names == ["vllm-cpu"]
    assert (args.vllm_threads_bind, args.vllm_kv_cache_gib) == ("all", 4)
    cmd = vllm_cpu.server_command(Path("/v/bin/python"), Path("/m"), 8001, 16, 2048)
    # its `vllm` script looks for a distribution named vllm and fails under vllm-cpu's name
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    env = vllm_cpu.server_env("all", 4)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0-1", "4")
    assert vllm_cpu.server_env("auto", 8)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_accuracy_reports_perplexity_agreement_and_the_int8_rank(
    llama_dir: Path, tmp_path: Path
) -> None:
    argv = ["--model", str(llama_dir), "--formats", "fp32,int8,w8a8", "--prompts", "2"]
    bundled = accuracy.HERE / "accuracy_text.txt"  # one piece: its pooled perplexity is its own
    argv += ["--tokens", "4", "--out-dir", str(tmp_path), "--more-text", str(bundled)]
    assert accuracy.main(argv) == 0
    report = json.loads((tmp_path / "accuracy.json").read_text())
    for name in ("fp32", "w8a8"):
        assert report[name]["perplexity_more_text"] == report[name]["perplexity"]
    assert set(report) == {"fp32", "int8", "w8a8", "command", "machine"}
    assert report["command"].startswith("python -m benchmarks.accuracy --model ")
    assert "--out-dir" not in report["command"]
    assert "worst_int8_rank_of_top_token" not in report["fp32"]
    # the tiny model's 256-token vocabulary: every rescored candidate is in the int8 top 64
    assert 0 <= report["int8"]["worst_int8_rank_of_top_token"] < RESCORED_CANDIDATES
    top_8 = report["int8"]["worst_int8_rank_of_top_8"]
    assert report["int8"]["worst_int8_rank_of_top_token"] <= top_8 < RESCORED_CANDIDATES
    # the int8 head re-scores the top candidates exactly: greedy equals fp32 on the tiny model
    assert report["int8"]["identical_outputs"] == "2/2"
    assert abs(report["int8"]["perplexity"] / report["fp32"]["perplexity"] - 1) < 0.01
