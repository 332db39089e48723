"""Shared fixtures: tiny models built once per session, engines and ASGI apps over them."""

# ruff: noqa: E402  (the test device and Triton's mode are chosen before torch is imported)

from __future__ import annotations

import os

# BEAMLINE_TEST_DEVICE=cuda runs every engine the tests build (make_engine, the serving fixtures,
# the parity and kernel tests) on that device, in float32 as on the CPU: references (HF on the CPU)
# and exact-token assertions stay as they are. CPU is the default.
TEST_DEVICE_NAME = os.environ.get("BEAMLINE_TEST_DEVICE", "cpu")
if TEST_DEVICE_NAME == "cpu":
    # Triton kernels run on CPU tensors through Triton's interpreter, which must be chosen before
    # anything imports triton (torch and transformers may, while they load).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n N`, the README's test command) each worker gets its share of the cores,
# and so does every process it starts (servers, clients, references): torch's threads of two
# workers on two cores spin against each other (3x slower), and so would a server's.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS_PER_WORKER = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS_PER_WORKER))

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import build_serving_context
from server.config import ServerConfig
from server.engine.async_engine import AsyncEngine
from server.engine.engine import Engine
from server.engine.fusion import Companions
from server.metrics import Metrics
from server.model.runner import ModelRunner
from tests.group_order import group_of
from tests.server_pool import PooledServer, close_pool, open_pool, pooled_server
from tests.tiny_models import build_tiny_model

pytest_plugins = ["tests.group_order"]  # longest test group first under `--dist loadgroup`
torch.set_num_threads(THREADS_PER_WORKER)
TEST_DEVICE = torch.device(TEST_DEVICE_NAME)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cpu_only` skip on another device (the GPU kit's run), with the reason.

    Under pytest-xdist's `--dist loadgroup` a file's tests run in one worker, so its module
    fixtures (a model, a server) are built once; the client suite's package-wide server too."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid)))
    if TEST_DEVICE_NAME == "cpu":
        return
    skip = pytest.mark.skip(reason=f"cpu_only: not on BEAMLINE_TEST_DEVICE={TEST_DEVICE_NAME}")
    for item in items:
        if item.get_closest_marker("cpu_only") is not None:
            item.add_marker(skip)


# The run's shared live servers (tests/server_pool.py): the process that begins the run opens
# the pool, xdist's workers inherit it, and its end stops every server in it.
_POOL_OWNED: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    if (folder := open_pool()) is not None:
        _POOL_OWNED.append(folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _POOL_OWNED:
        close_pool(_POOL_OWNED.pop())


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in process (`server.cli.main`) sets the root logger up as a
    server does: its own handler, on the stderr pytest captured for that test, replaces the
    others. Put the root logger back, so later tests' records reach pytest's handlers only."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def default_server() -> PooledServer:
    """`beamline serve` of the default model, shared by the whole run."""
    return pooled_server("default")


@pytest.fixture(scope="session")
def tiny_server() -> PooledServer:
    """`beamline serve` of a tiny random Gemma 3 named gemma-3-270m, shared by the whole run."""
    return pooled_server("tiny")


# Clients the client suite ran (tests/clients/), with their versions, from the tests' reports:
# the xdist controller prints the summary but runs no test.
CLIENT_VERSIONS: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == "client_versions":
            CLIENT_VERSIONS.update(value)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CLIENT_VERSIONS:
        versions = ", ".join(f"{k} {v}" for k, v in sorted(CLIENT_VERSIONS.items()))
        terminalreporter.write_line(f"client versions: {versions}")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: build_tiny_model(root / arch, arch)
        for arch in ("llama", "gemma3", "qwen2", "mistral")
    }


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


def make_engine(
    model_dir: Path,
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    overlap_outputs: bool = False,
    speculative_tokens: int = 0,
    async_scheduling: bool = False,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    linear_layout: str = "native",
    quantization: str = "none",
    companions: Companions | None = None,
) -> Engine:
    """`linear_layout` native by default: auto picks the CPU's layouts by timing them at each
    start, and two engines of one test may then round differently (tests/test_cpu_linear.py
    covers the layouts themselves)."""
    runner = ModelRunner(
        model_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=block_size,
        num_blocks=num_blocks,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        linear_layout=linear_layout,
        quantization=quantization,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Engine(
        runner,
        tokenizer,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        overlap_outputs=overlap_outputs,
        speculative_tokens=speculative_tokens,
        async_scheduling=async_scheduling,
        max_cpu_loras=max_cpu_loras,
        companions=companions,
    )


def hf_reference(model_dir: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def serving_context(engine: Engine, name: str = "tiny", **config: object) -> ServingContext:
    metrics = Metrics(name)
    engine.use_metrics(metrics)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    return ServingContext(
        engine=async_engine,
        tokenizer=engine.tokenizer,
        model_name=name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.runner.vocab_size,
        config=ServerConfig(**config),
        metrics=metrics,
    )


@contextlib.asynccontextmanager
async def started_client(
    model_dir: Path, name: str, **config: object
) -> AsyncIterator[httpx.AsyncClient]:
    """`model_dir` started as `beamline serve` starts it (the CPU, a small KV pool, the engine in
    a thread unless `config` says otherwise), behind an ASGI client; stopped after."""
    settings: dict = dict(
        model=str(model_dir),
        served_model_name=name,
        device="cpu",
        num_kv_blocks=128,
        block_size=4,
        engine_process="off",
    )
    ctx = build_serving_context(ServerConfig(**(settings | config)))
    transport = httpx.ASGITransport(app=create_app(ctx=ctx))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            yield c
    finally:
        ctx.engine.shutdown()


@pytest.fixture
def tiny_ctx(llama_dir: Path) -> Iterator[ServingContext]:
    ctx = serving_context(make_engine(llama_dir))
    yield ctx
    ctx.engine.shutdown()


@pytest.fixture
async def client(tiny_ctx: ServingContext) -> httpx.AsyncClient:
    app = create_app(ctx=tiny_ctx)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
