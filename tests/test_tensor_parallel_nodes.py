"""Tensor-parallel ranks spread over two "nodes" (two `beamline serve` processes on this host, as
on two machines: the same command with --nnodes 2 and each its --node-rank, meeting at
MASTER_ADDR:MASTER_PORT): node 0 serves what one rank serves, node 1 opens no port, and a SIGTERM
to node 0 drains and then ends node 1's ranks too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server import cli
from server.parallel.group import free_port
from tests.test_shutdown import REPO, wait_healthy

pytestmark = pytest.mark.timeout(300)
BODY = {"prompt": "Hello world! How are you", "max_tokens": 16, "temperature": 0}


def serve(
    model: Path, port: int, log: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", str(port),
        "--dtype", "float32", "--linear-layout", "native", "--num-kv-blocks", "128",
        "--block-size", "4", "--num-threads", "1", *flags,
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )


def completion(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_nodes_serve_what_one_rank_serves_and_stop_together(
    llama_dir: Path, tmp_path: Path
) -> None:
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    multi = ["--tensor-parallel-size", "2", "--nnodes", "2"]
    ports = [free_port(), free_port(), free_port()]
    logs = [tmp_path / f"node{i}.log" for i in range(3)]
    node1 = serve(llama_dir, ports[1], logs[1], *multi, "--node-rank", "1", env=rendezvous)
    node0 = serve(llama_dir, ports[0], logs[0], *multi, "--node-rank", "0", env=rendezvous)
    single = serve(llama_dir, ports[2], logs[2])
    procs = [node0, node1, single]
    try:
        for proc, port, log in [(node0, ports[0], logs[0]), (single, ports[2], logs[2])]:
            wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        assert completion(f"http://127.0.0.1:{ports[0]}") == completion(
            f"http://127.0.0.1:{ports[2]}"
        )
        with pytest.raises(httpx.ConnectError):  # a node past the first opens no port
            httpx.get(f"http://127.0.0.1:{ports[1]}/health", timeout=2)
        assert "node 1 of 2: ranks 1-1" in logs[1].read_text()

        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=60) == 0, logs[0].read_text()[-3000:]
        assert node1.wait(timeout=60) == 0, logs[1].read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def test_nodes_without_a_rendezvous_address_are_refused(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    args = ["serve", "--model", str(llama_dir), "--tensor-parallel-size", "2", "--nnodes", "2"]
    assert cli.main([*args, "--node-rank", "1"]) == 2
    assert "MASTER_ADDR:MASTER_PORT" in capsys.readouterr().err


def test_ranks_that_do_not_divide_over_the_nodes_are_a_config_error(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["serve", "--model", str(llama_dir), "--tensor-parallel-size", "3", "--nnodes", "2"]
    assert cli.main(args) == 2
    assert "must divide evenly over nnodes" in capsys.readouterr().err
