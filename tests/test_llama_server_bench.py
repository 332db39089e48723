"""llama-server as a baseline of benchmarks.serve: the command line it is started with, the cached
build, and one full run through a stand-in binary (tests/fixtures/fake_llama_server.py): one
server per concurrency level with that many slots, measured like any other server."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from benchmarks import serve
from benchmarks.serving import llama_server
from tests.live_server import live_server
from tests.test_benchmarks import fake_openai_app

FAKE = Path(__file__).resolve().parent / "fixtures" / "fake_llama_server.py"


def test_the_server_gets_a_slot_per_client_continuous_batching_and_every_core() -> None:
    cmd = llama_server.server_command(Path("/b/llama-server"), Path("/m.gguf"), 8080, 16, 2, 1024)
    assert cmd[0] == "/b/llama-server"

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--parallel") == "16" and value("--threads") == value("--threads-batch") == "2"
    assert value("--ctx-size") == str(16 * 1024) and value("--host") == "127.0.0.1"
    assert "--cont-batching" in cmd and "--no-webui" in cmd


def test_the_build_names_its_cpu_extensions_and_never_downloads_a_web_ui() -> None:
    assert "-DGGML_NATIVE=OFF" in llama_server.BUILD_FLAGS  # SIGILL on these VMs otherwise
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in llama_server.BUILD_FLAGS
    assert "-DGGML_AVX512=ON" in llama_server.BUILD_FLAGS


def fake_binary(cache: Path) -> Path:
    binary = cache / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def stand_in_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The stand-in binary as the cached build; returns its call log and a GGUF to pass."""
    monkeypatch.setenv("BEAMLINE_CACHE_DIR", str(tmp_path / "cache"))
    fake_binary(llama_server.cache_dir())
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(calls))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return calls, gguf


def test_a_cached_build_is_used_as_it_is(tmp_path: Path) -> None:
    binary = fake_binary(tmp_path)
    assert llama_server.build(tmp_path) == binary  # no download, no cmake


@pytest.mark.timeout(180)
def test_serve_runs_llama_server_per_level_in_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, gguf = stand_in_llama_server(tmp_path, monkeypatch)

    with live_server(fake_openai_app()) as url:
        code = serve.main(
            ["--base-url", url, "--baselines", "llama-server", "--gguf", str(gguf)]
            + ["--num-requests", "6", "--output-tokens", "2,5", "--concurrency", "1,3"]
            + ["--llama-threads", "2", "--out-dir", str(tmp_path), "--tag", "run"]
        )
    assert code == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    runs = doc["systems"]["llama-server"]["runs"]
    assert [r["x"] for r in runs] == [1, 3]
    for run in runs:
        m = run["metrics"]
        assert m["completed"] == 6 and m["errors"] == 0
        assert m["total_output_tokens"] == doc["workload"]["output_tokens_total"]
    started = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [s["parallel"] for s in started] == [1, 3]  # a server per level, a slot per client
    assert all(
        s["threads"] == 2 and s["cont_batching"] and s["model"] == str(gguf) for s in started
    )
    assert {r["baseline"] for r in doc["ratios"]} >= {"llama-server"}
    assert os.path.exists(doc["plot"])


@pytest.mark.timeout(180)
def test_grounded_workload_runs_llama_server_with_and_without_its_ngram_speculation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat requests to beamline and to both llama-servers; the second one with --spec-type."""
    calls, gguf = stand_in_llama_server(tmp_path, monkeypatch)

    app = fake_openai_app()
    with live_server(app) as url:
        code = serve.main(
            ["--base-url", url, "--dataset", "grounded", "--gguf", str(gguf)]
            + ["--num-requests", "4", "--output-tokens", "2,4", "--concurrency", "2"]
            + ["--out-dir", str(tmp_path), "--tag", "run", "--warmup", "0"]
        )
    assert code == 0
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["workload"]["name"] == "grounded" and doc["workload"]["chat"]
    assert len(app.state.chat_requests) == 4  # the system under test got chat requests
    assert set(doc["systems"]) == {"server", "llama-server", "llama-server-ngram"}
    started = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [s["spec_type"] for s in started] == [None, "ngram-simple"]
    assert [s["spec_ngram_simple_size_n"] for s in started] == [None, 3]
    for name in ("llama-server", "llama-server-ngram"):
        m = doc["systems"][name]["runs"][0]["metrics"]
        assert m["completed"] == 4 and m["errors"] == 0
    with pytest.raises(SystemExit):  # raw-prompt baselines have no chat form
        serve.resolve_args(["--base-url", url, "--dataset", "grounded", "--baselines", "hf-static"])
