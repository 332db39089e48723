"""The command line as the ecosystem types it: `beamline serve [MODEL]` (or --model, not both),
flags grouped by purpose in --help, `beamline --version`, `beamline bench serve --url URL`; and
how `beamline serve` ends when the model cannot be found or loaded (exit 1, one line, quickly)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import server.cli
import server.http_server
from server.bootstrap import ModelLoadFailed
from server.cli import CONFIG_ONLY_KEYS, build_parser, main
from server.config import ServerConfig
from server.config_groups import CONFIG_GROUPS
from tests.live_server import free_port

REPO = Path(__file__).resolve().parents[1]


def served_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The config `beamline serve *argv` would start the server with (nothing is started)."""
    started: list[ServerConfig] = []
    monkeypatch.setattr(server.cli, "setup_logging", lambda *args: None)
    monkeypatch.setattr(server.http_server, "run_server", started.append)
    assert main(["serve", *argv]) == 0
    return started[0]


def test_the_model_is_a_positional_argument_or_the_flag(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_position = served_config([str(llama_dir)], monkeypatch)
    by_flag = served_config(["--model", str(llama_dir)], monkeypatch)
    assert by_position.model == by_flag.model == str(llama_dir)
    assert by_position.served_model_name == by_flag.served_model_name == llama_dir.name


def test_a_model_given_both_ways_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "org/a", "--model", "org/b"])
    assert exited.value.code == 2
    assert "give the model once: as MODEL or as --model, not both" in capsys.readouterr().err


def test_an_unknown_serve_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-num-seq", "4", "--bogus"])
    assert exited.value.code == 2 and "--bogus" in capsys.readouterr().err


def test_every_config_key_has_exactly_one_group() -> None:
    grouped = [name for names in CONFIG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(ServerConfig.model_fields)


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices["serve"]


def test_help_lists_the_flags_under_their_groups_in_order() -> None:
    parser = serve_parser()
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for title, names in CONFIG_GROUPS.items():
        assert groups[title] == set(names) - CONFIG_ONLY_KEYS, title
    text = parser.format_help()
    positions = [text.index(f"\n{title}:") for title in CONFIG_GROUPS]
    assert positions == sorted(positions)
    assert "max_n, max_best_of" in text  # the group says which of its keys have no flag
    assert text.startswith("usage: beamline serve [MODEL] [options]")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == "beamline 0.1.0"


@pytest.mark.parametrize(
    ("argv", "passed"),
    [
        (
            ["--url", "http://10.0.0.2:8080", "--concurrency", "1,4"],
            ["--base-url", "http://10.0.0.2:8080", "--concurrency", "1,4", "--baselines", "none"],
        ),
        ([], ["--base-url", "http://127.0.0.1:8000", "--baselines", "none"]),
        (
            ["--request-rate", "2", "--baselines", "llama-server", "--model-name", "m"],
            [
                "--base-url",
                "http://127.0.0.1:8000",
                "--request-rate",
                "2",
                "--baselines",
                "llama-server",
                "--model-name",
                "m",
            ],
        ),  # fmt: skip
    ],
)
def test_bench_serve_runs_the_serving_benchmark_against_the_url(
    argv: list[str], passed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.serve

    calls: list[list[str]] = []
    monkeypatch.setattr(benchmarks.serve, "main", lambda a: calls.append(a) or 0)
    assert main(["bench", "serve", *argv]) == 0
    assert calls == [passed]


def test_a_missing_model_ends_serve_with_exit_1_and_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.cli, "setup_logging", lambda *args: None)
    assert main(["serve", "/nonexistent/model"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("beamline: model '/nonexistent/model': no such directory or .gguf file")
    assert "\n" not in err


def test_a_model_that_fails_to_load_ends_serve_with_exit_1(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(config: ServerConfig) -> None:
        raise ModelLoadFailed("no weights")

    monkeypatch.setattr(server.cli, "setup_logging", lambda *args: None)
    monkeypatch.setattr(server.http_server, "run_server", failing)
    assert main(["serve", str(llama_dir)]) == 1


def run_cli(*argv: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done, time.monotonic() - started


@pytest.mark.timeout(120)
def test_serve_with_a_nonexistent_model_exits_at_once() -> None:
    done, took = run_cli("--model", "/nonexistent", timeout=60)
    assert done.returncode == 1 and took < 30
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("beamline: model '/nonexistent': no such directory or .gguf file")
    assert "Traceback" not in done.stderr and "Uvicorn running" not in done.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_serve_with_a_model_that_fails_while_loading_exits_1(
    tmp_path: Path, engine_process: str
) -> None:
    """The port opened (the model's files were found), loading failed: the server stops."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    port = str(free_port())
    flags = ["--port", port, "--num-kv-blocks", "16", "--engine-process", engine_process]
    done, _ = run_cli(str(broken), *flags, timeout=150)
    assert done.returncode == 1, done.stderr[-2000:]
    failure = [line for line in done.stderr.splitlines() if "model failed to load" in line]
    assert len(failure) == 1 and str(broken) in failure[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
