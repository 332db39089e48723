"""Start-up tells the truth: a line before the port opens says what loading will do; uvicorn's
"Application startup complete" (the app starts as the port opens, long before the model is
ready) is a debug line and "ready: serving ..." says when it is; no colour codes in the lines;
health probes and metrics scrapes log at DEBUG; the context limit says where it comes from."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from server.logs import JsonFormatter, TextFormatter, UvicornLifespanAtDebug
from server.model import gguf_files, loader
from server.model.kv_budget import KVBudget, plan_num_blocks
from server.model.loader import LocatedModel, conversion_dir, loading_plan
from tests.hub_cache import commit_of, model_files, write_snapshot
from tests.live_server import free_port

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "tiny-org/tiny-llama"


def uvicorn_record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "uvicorn.error", "msg": msg, "levelno": logging.INFO})
    record.levelname = "INFO"
    record.__dict__.update(extra)
    return record


def test_lines_carry_no_colour_codes() -> None:
    record = uvicorn_record(
        "Uvicorn running on %s", color_message="Uvicorn running on \x1b[1m%s\x1b[0m"
    )
    record.args = ("http://127.0.0.1:8000",)
    text = TextFormatter().format(record)
    assert "color_message" not in text and "\x1b" not in text
    assert "color_message" not in json.loads(JsonFormatter().format(record))


@pytest.mark.parametrize("root_level", [logging.INFO, logging.DEBUG])
def test_uvicorns_startup_complete_is_a_debug_line(root_level: int) -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(root_level)  # what --log-level sets
    try:
        quiet = UvicornLifespanAtDebug()
        complete = uvicorn_record("Application startup complete.")
        assert quiet.filter(complete) is (root_level == logging.DEBUG)
        assert complete.levelname == "DEBUG"
        assert quiet.filter(uvicorn_record("Uvicorn running on %s")) is True
    finally:
        root.setLevel(before)


async def test_probes_and_scrapes_log_at_debug(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="beamline.access")
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        await client.get(path)
    access = [r for r in caplog.records if r.name == "beamline.access"]
    levels = {r.getMessage().split()[1]: r.levelname for r in access}
    assert levels == {
        "/health": "DEBUG",
        "/ready": "DEBUG",
        "/metrics": "DEBUG",
        "/v1/models": "INFO",
    }


def plan_context(caplog: pytest.LogCaptureFixture, budget: KVBudget, **kwargs: object) -> str:
    """The context-limit line of a CPU pool of 1 MiB blocks of 16 tokens, a 32k-token model."""
    args: dict[str, object] = dict(
        num_blocks=None,
        bytes_per_block=2**20,
        block_size=16,
        device=torch.device("cpu"),
        max_model_len=32768,
        profile=lambda: 0,
    )
    with caplog.at_level(logging.INFO, logger="server.model.kv_budget"):
        plan_num_blocks(budget, **{**args, **kwargs})  # type: ignore[arg-type]
    return caplog.records[-1].getMessage()


def test_the_context_limit_says_what_set_it(caplog: pytest.LogCaptureFixture) -> None:
    cpu_auto = plan_context(caplog, KVBudget())  # 1 GiB = 1,024 blocks of 16 tokens
    assert cpu_auto.startswith(
        "max_model_len 16,384 tokens: what the KV pool (1,024 blocks of 16 tokens, 1.00 GiB: "
        "kv_cache_memory auto = 1 GiB on the CPU) holds for one sequence (the model allows "
        "32,768); --kv-cache-memory or --max-model-len to change"
    )
    by_blocks = plan_context(
        caplog, KVBudget(max_model_len=8192), num_blocks=100, max_model_len=8192
    )
    assert "max_model_len 1,600 tokens" in by_blocks and "num_kv_blocks" in by_blocks
    assert "--max-model-len asks 8,192" in by_blocks
    whole = plan_context(caplog, KVBudget(kv_cache_bytes=4 * 2**30))
    assert whole.startswith("max_model_len 32,768 tokens: the model's context length")


def test_the_line_before_the_port_opens_says_whether_a_gguf_is_converted(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    first = loading_plan(LocatedModel(gguf, "m"), tmp_path)
    assert first.startswith(f"loading m: converting {gguf} once into ")
    assert "s on a 2-core CPU; later starts load the converted copy" in first
    target = conversion_dir(gguf, tmp_path)
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert loading_plan(LocatedModel(gguf, "m"), tmp_path) == (
        f"loading m from {target} (converted from m.gguf)"
    )


class FakeSaved:
    """Stands in for the converted model and tokenizer: `save_pretrained` writes one file; the
    model's first runs `meanwhile` (another process finishing its conversion first)."""

    hf_quantizer = None
    config = object()
    generation_config = None

    def __init__(self, name: str, meanwhile: Callable[[], None] = lambda: None) -> None:
        self.name, self.meanwhile = name, meanwhile

    def save_pretrained(self, folder: Path) -> None:
        self.meanwhile()
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / self.name).write_text(json.dumps({"by": os.getpid()}))


@pytest.mark.parametrize("raced", [False, True], ids=["alone", "another-process-first"])
def test_a_gguf_conversion_lands_whole_and_the_first_copy_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raced: bool
) -> None:
    """Each process converts into a folder of its own and renames it into place: two servers
    starting at once never see a half-written copy, and the one that finishes second keeps the
    first's copy."""
    import transformers

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    target = conversion_dir(gguf, tmp_path)

    def other_process_finishes() -> None:
        if raced:
            target.mkdir()
            (target / "config.json").write_text('{"by": "the other process"}')

    class TokenizerSaved:  # the tokenizer's process, done
        def __init__(self, gguf: Path, folder: Path) -> None:
            FakeSaved("tokenizer.json").save_pretrained(folder)

        def result(self) -> None:
            return None

    model = FakeSaved("config.json", other_process_finishes)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(loader, "TokenizerProcess", TokenizerSaved)
    loader.convert_gguf(gguf, target)
    landed = ["config.json"] if raced else ["config.json", "tokenizer.json"]
    assert sorted(p.name for p in target.iterdir()) == landed
    by = json.loads((target / "config.json").read_text())["by"]
    assert by == ("the other process" if raced else os.getpid())
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


@pytest.mark.timeout(240)
def test_a_served_hub_model_logs_loading_then_ready_and_no_noise(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`beamline serve org/name` from a Hugging Face cache on disk, offline, as a user runs it."""
    cache = tmp_path / "hf-cache"
    snapshot = write_snapshot(cache, HUB_ID, model_files(llama_dir), commit_of("a"), ("main",))
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "server.cli", "serve", HUB_ID, "--port", str(port)]
    cmd += ["--num-kv-blocks", "16", "--block-size", "16", "--num-threads", "1"]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == HUB_ID
        body = {"model": HUB_ID, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    text = log.read_text()
    loading = text.index(f"loading {HUB_ID} from {snapshot}; the port opens now")
    assert (
        loading
        < text.index("Uvicorn running on")
        < text.index(f"ready: serving {HUB_ID} on {url}, loaded in ")
    )
    assert "max_model_len 256 tokens: what the KV pool (16 blocks of 16 tokens" in text
    assert "(the model allows 512)" in text
    assert "Application startup complete" not in text and "Waiting for application" not in text
    assert "color_message" not in text and "\x1b[" not in text
    assert "GET /health" not in text and "POST /v1/completions 200" in text
    assert proc.returncode == 0


def test_a_gguf_file_is_parsed_once_while_it_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers builds a GGUF reader for the config, the tokenizer and the weights; within
    `gguf_parsed_once` they share one per file, and the reader transformers builds is that one
    (it imports `gguf.GGUFReader` at each call). Afterwards gguf's own reader is back."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    built: list[str] = []

    class Parsed(Exception):
        pass

    class CountingReader:
        def __init__(self, path: str, mode: str = "r") -> None:
            built.append(str(path))

        @property
        def fields(self) -> dict:
            raise Parsed  # far enough: transformers asked this reader

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    with gguf_files.gguf_parsed_once():
        for path in (first, first, second):
            with pytest.raises(Parsed):
                load_gguf_checkpoint(str(path))
        assert gguf.GGUFReader(str(first)) is gguf.GGUFReader(str(first))
    assert built == [str(first), str(second)]
    assert gguf.GGUFReader is CountingReader


def test_each_tensor_name_map_is_built_once_while_a_gguf_file_converts(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers asks gguf for a tensor-name map per module of the model it loads; within
    `gguf_parsed_once` gguf builds one per architecture and depth, and the names are gguf's."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    built: list[tuple[object, int]] = []
    real = gguf.get_tensor_name_map

    def counted(arch: gguf.MODEL_ARCH, n_blocks: int) -> gguf.TensorNameMap:
        built.append((arch, n_blocks))
        return real(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["gemma3"])
    expected = get_gguf_hf_weights_map(model, TensorProcessor())
    modules = len(built)
    assert modules > 10 and len(set(built)) == 1  # one map asked for again and again
    built.clear()
    with gguf_files.gguf_parsed_once():
        assert get_gguf_hf_weights_map(model, TensorProcessor()) == expected
    assert len(built) == 1
    assert gguf.get_tensor_name_map is counted


def test_the_plain_view_reader_parses_a_gguf_file_as_ggufs_own_reader(tmp_path: Path) -> None:
    """`gguf_parsed_once` parses through a plain view of the memory map (no `numpy.memmap` per
    slice): the same fields, values and tensors as gguf's reader, on a file with a vocabulary."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"tok{i}".encode() for i in range(300)] + ["▁ü".encode()])
    writer.add_token_scores([float(-i) for i in range(301)])
    writer.add_token_types([1] * 301)
    writer.add_uint32("llama.context_length", 64)
    writer.add_tensor("w", np.arange(24, dtype=np.float32).reshape(4, 6))
    writer.add_tensor("b", np.ones(7, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_files.plain_view_reader(gguf.GGUFReader)(str(path))
    theirs = gguf.GGUFReader(str(path))
    assert type(ours.data) is np.ndarray and type(theirs.data) is np.memmap
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset)
        assert len(mine.parts) == len(field.parts)
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


class BusyThenIdle:
    """An engine client's stats: a request running for the first `busy` polls, then none."""

    def __init__(self, busy: int) -> None:
        self.polls = 0
        self.busy = busy

    def stats(self) -> dict[str, int]:
        self.polls += 1
        return {"num_requests_running": int(self.polls <= self.busy), "num_requests_waiting": 0}


class CountedGrammars:
    def __init__(self, engine: BusyThenIdle) -> None:
        self.engine = engine
        self.prepared_at_poll: int | None = None

    def prepare(self) -> bool:
        self.prepared_at_poll = self.engine.polls
        return True


@pytest.mark.parametrize("busy", [5, 10**9])
def test_the_grammar_tokenizer_is_built_once_the_engine_is_idle_or_at_the_latest(
    monkeypatch: pytest.MonkeyPatch, busy: int
) -> None:
    """llguidance holds the GIL while it reads the tokenizer: built in the first idle second
    after start-up (here 0.035 s: 4 idle polls of 0.01 s), not while requests run; or, never
    idle, at the latest (here 0.3 s)."""
    from types import SimpleNamespace

    from server import bootstrap

    monkeypatch.setattr(bootstrap, "IDLE_BEFORE_GRAMMARS_S", 0.035)
    monkeypatch.setattr(bootstrap, "GRAMMARS_AT_THE_LATEST_S", 0.3)
    frozen_at_poll: list[int] = []
    monkeypatch.setattr(
        bootstrap, "freeze_start_up_objects", lambda: frozen_at_poll.append(engine.polls)
    )
    engine = BusyThenIdle(busy)
    grammars = CountedGrammars(engine)
    started = time.monotonic()
    bootstrap.after_start_up(SimpleNamespace(engine=engine, grammars=grammars), poll_s=0.01)
    took = time.monotonic() - started
    assert grammars.prepared_at_poll is not None
    assert frozen_at_poll == [grammars.prepared_at_poll]  # start-up's objects frozen first
    if busy == 5:
        assert busy + 4 <= grammars.prepared_at_poll <= busy + 10 and took < 0.3
    else:
        assert took >= 0.3  # never idle: at the deadline
