"""Every command of README.md and docs/ is run, checked or skipped with a reason
(tests/doc_commands.py reads the blocks and their markers).

`run` blocks go to one live `beamline serve` of a tiny random Gemma 3 served as `gemma-3-270m`
(started once for the module, like a user starts it; `localhost:8000` and `127.0.0.1:8000` in a
block point at it, and `curl` fails on an HTTP error); `serve` blocks have each `beamline serve`
line parsed by the real parser and its configuration validated; `ci` blocks must appear verbatim
in .ci/run (README's test command is the one CI runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_commands import (
    COMMAND_LANGUAGES,
    KINDS,
    ROOT,
    Block,
    all_markers,
    command_blocks,
)
from tests.server_pool import PooledServer

BLOCKS = command_blocks()
RUN = [b for b in BLOCKS if b.kind == "run"]
SERVE = [b for b in BLOCKS if b.kind == "serve"]
BLOCK_TIMEOUT_S = 180
# A `run` block's shell: fail on any error, curl on any HTTP error status too.
BASH_PRELUDE = """set -euo pipefail
curl() { command curl --fail-with-body --max-time 120 "$@"; }
"""
SERVE_PRELUDE = """set -eo pipefail
beamline() { "$PYTHON" -m tests.doc_commands "$@"; }
"""


def ids(blocks: list[Block]) -> list[str]:
    return [b.name for b in blocks]


def test_every_command_block_says_what_the_test_does_with_it() -> None:
    unmarked = [b.name for b in BLOCKS if b.kind is None]
    assert not unmarked, f"command blocks without a <!-- doctest: ... --> marker: {unmarked}"
    for block in BLOCKS:
        assert block.kind in KINDS, (block.name, block.kind)
        if block.kind == "skip":
            assert len(block.reason) >= 10, f"{block.name}: a skip says why"
        if block.kind == "run":
            assert block.language in ("bash", "sh", "shell", "python"), block.name


def test_every_marker_sits_on_a_command_block() -> None:
    for marker in all_markers():
        assert marker.kind in KINDS, f"{marker.path}:{marker.line}: unknown kind {marker.kind}"
        assert marker.fenced, f"{marker.path}:{marker.line}: no fenced block after the marker"
    command = {(b.path, b.line - 1) for b in BLOCKS}
    for marker in all_markers():
        assert (marker.path, marker.line) in command, (
            f"{marker.path}:{marker.line}: the block is not one of {sorted(COMMAND_LANGUAGES)}"
        )


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    ci_run = (ROOT / ".ci" / "run").read_text()
    ci_blocks = [b for b in BLOCKS if b.kind == "ci"]
    assert any(b.path.name == "README.md" for b in ci_blocks), "README has no ci block"
    for block in ci_blocks:
        for line in block.code.strip().splitlines():
            assert line in ci_run, f"{block.name}: {line!r} is not in .ci/run"
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e . && beamline serve" in readme


def test_the_docs_show_chat_with_an_instruction_tuned_model() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "beamline serve google/gemma-3-270m-it" in readme
    assert "base" in readme.split("## ", 2)[0] + readme.split("## ", 2)[1]


@pytest.mark.parametrize("block", SERVE, ids=ids(SERVE))
def test_serve_commands_are_accepted_by_the_parser(block: Block) -> None:
    assert "beamline serve" in block.code, block.name
    result = subprocess.run(
        ["bash", "-c", SERVE_PRELUDE + block.code],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{block.name}:\n{block.code}\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def served(tiny_server: PooledServer) -> str:
    """The run's `beamline serve` of a tiny random Gemma 3 named like the default model; its
    address."""
    return tiny_server.url.removeprefix("http://")


def pointed_at(code: str, address: str) -> str:
    return code.replace("localhost:8000", address).replace("127.0.0.1:8000", address)


@pytest.mark.parametrize("block", RUN, ids=ids(RUN))
def test_run_commands_succeed_against_a_live_server(block: Block, served: str) -> None:
    code = pointed_at(block.code, served)
    if block.language == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-c", BASH_PRELUDE + code]
    bin_dir = str(Path(sys.executable).parent)  # `beamline` and `python` of this environment
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}:\n{code}\n--- stdout ---\n"
        f"{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}"
    )
