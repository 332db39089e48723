"""An encoder-decoder model in the rest of the server: the tokenizer routes and the model list,
clients that hang up (the source's blocks and every beam's freed, the request counted aborted),
the SIGTERM drain of the real CLI with the engine in a process of its own (in-flight beams run to
their last token), and a model named by hub id, served offline from a cache built on disk."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from huggingface_hub import constants
from transformers import AutoTokenizer

from server.api.app import create_app
from server.bootstrap import build_serving_context, prepare_model
from server.config import ServerConfig
from tests.conftest import started_client
from tests.hub_cache import commit_of, model_files, write_snapshot
from tests.live_server import free_port, live_server
from tests.reliability_helpers import aborted_total, assert_openai_error, wait_until_idle
from tests.test_disconnects import hang_up, raw_request, read_events, wait_running
from tests.test_shutdown import wait_draining, wait_healthy, wait_in_flight
from tests.tiny_seq2seq import build_tiny_seq2seq

SOURCE = "The quick brown fox jumps over the lazy dog."
# long enough (4 beams of it on one thread) to outlast the checks made while it runs
LONG = {"max_tokens": 400, "min_tokens": 400, "num_beams": 4, "temperature": 0}


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # T5: relative positions, so a decoder of 512 positions (long requests)
    return build_tiny_seq2seq(tmp_path_factory.mktemp("seq2seq_serving") / "t5", "t5")


async def test_the_tokenizer_routes_read_a_source_as_completions_do(t5_dir: Path) -> None:
    async with started_client(t5_dir, "t5") as client:
        tokenized = await client.post("/tokenize", json={"prompt": SOURCE})
        assert tokenized.status_code == 200
        ids = tokenized.json()["tokens"]
        assert ids == AutoTokenizer.from_pretrained(t5_dir)(SOURCE).input_ids  # with its </s>
        body = {"prompt": SOURCE, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        done = (await client.post("/v1/completions", json=body)).json()
        choice = done["choices"][0]
        assert choice["prompt_token_ids"] == ids and done["usage"]["prompt_tokens"] == len(ids)
        text = await client.post("/detokenize", json={"tokens": choice["token_ids"]})
        assert text.status_code == 200
        assert text.json()["prompt"].replace("</s>", "").strip() == choice["text"].strip()
        # messages: as the chat routes answer on this model
        chat = await client.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert_openai_error(chat, 400, param="messages", code="unsupported_model")
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["t5"]


@pytest.fixture(scope="module")
def live_t5(t5_dir: Path) -> Iterator[tuple[str, str, int]]:
    config = ServerConfig(
        model=str(t5_dir), device="cpu", num_kv_blocks=512, block_size=4, engine_process="off",
        num_threads=1,
    )  # fmt: skip
    ctx = build_serving_context(config)
    try:
        with live_server(create_app(ctx=ctx)) as url:
            host, port = url.removeprefix("http://").split(":")
            yield url, host, int(port)
    finally:
        ctx.engine.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["beams", "streamed-samples"])
async def test_a_client_that_hangs_up_frees_the_source_and_every_beam(
    live_t5: tuple[str, str, int], stream: bool
) -> None:
    url, host, port = live_t5
    body = {"prompt": SOURCE, **LONG}
    if stream:  # a stream of 4 samples (as many rows a step as the beams), cut early
        body |= {"num_beams": 1, "n": 4, "temperature": 1.0, "seed": 0, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        await wait_until_idle(client, timeout=5)
        before = aborted_total((await client.get("/metrics")).text)
        head, payload = raw_request("/v1/completions", body, host)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + payload)
        await writer.drain()
        await wait_running(client)
        stats = (await client.get("/v1/engine/stats")).json()
        assert stats["kv_blocks_free"] < stats["kv_blocks_total"]  # the source's, the beams'
        if stream:
            await read_events(reader, 2, timeout=30)
        await hang_up(writer, reset=False)
        stats = await wait_until_idle(client, timeout=5.0)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert aborted_total((await client.get("/metrics")).text) == before + 1
        # and it serves on
        again = await client.post("/v1/completions", json={"prompt": SOURCE, "max_tokens": 3})
        assert again.status_code == 200


def beams_request(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": SOURCE, **LONG}, timeout=120)


@pytest.mark.timeout(300)
def test_sigterm_lets_in_flight_beams_finish_with_the_engine_in_its_own_process(
    t5_dir: Path, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "server.log"
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(t5_dir), "--host",
        "127.0.0.1", "--port", str(port), "--num-kv-blocks", "1024", "--num-threads", "1",
        "--engine-process", "on", "--drain-timeout", "90",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        with ThreadPoolExecutor(max_workers=2) as pool:
            running = [pool.submit(beams_request, url) for _ in range(2)]
            wait_in_flight(url, 2)
            proc.send_signal(signal.SIGTERM)
            assert_openai_error(wait_draining(url), 503, code="draining")
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": SOURCE}, timeout=5)
            assert_openai_error(refused, 503, code="draining")
            for done in running:  # each ran to its last token
                response = done.result(timeout=150)
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


async def test_a_model_named_by_hub_id_serves_offline_from_the_cache(
    t5_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = "tiny-org/tiny-t5"
    snapshot = write_snapshot(cache, repo, model_files(t5_dir), commit_of("a"), refs=("main",))
    config = prepare_model(ServerConfig(model=repo, device="cpu"))  # as `beamline serve` does
    assert (Path(config.model or ""), config.served_model_name) == (snapshot, repo)
    body = {"model": repo, "prompt": SOURCE, "max_tokens": 5, "num_beams": 2, "temperature": 0}
    async with started_client(snapshot, repo) as client:
        by_id = await client.post("/v1/completions", json=body)
    async with started_client(t5_dir, repo) as client:
        by_dir = await client.post("/v1/completions", json=body)
    assert by_id.status_code == by_dir.status_code == 200
    assert by_id.json()["choices"][0]["text"] == by_dir.json()["choices"][0]["text"]


async def test_the_server_drafts_n_grams_for_these_models_as_for_any(t5_dir: Path) -> None:
    """The default speculation is on for an encoder-decoder model too (this tiny T5 repeats
    itself, so its drafts are accepted), and the text is the text without it."""
    body = {"prompt": SOURCE, "max_tokens": 24, "temperature": 0}
    async with started_client(t5_dir, "t5") as client:  # the default: 8 speculative tokens
        drafted = (await client.post("/v1/completions", json=body)).json()
        stats = (await client.get("/v1/engine/stats")).json()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    async with started_client(t5_dir, "t5", num_speculative_tokens=0) as client:
        plain = (await client.post("/v1/completions", json=body)).json()
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]
