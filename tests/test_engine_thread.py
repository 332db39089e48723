"""Start-up work that must happen in the engine's own thread (compiling, CUDA-graph recording)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from server.engine.async_engine import AsyncEngine
from tests.conftest import make_engine


def test_warm_up_runs_in_the_engine_thread_before_start_returns(llama_dir: Path) -> None:
    seen: list[str] = []
    engine = AsyncEngine(make_engine(llama_dir))
    engine.start(warm_up=lambda: seen.append(threading.current_thread().name))
    try:
        assert seen == ["beamline-engine"]  # done, and where the steps run
        assert engine.alive
    finally:
        engine.shutdown()


def test_a_failing_warm_up_fails_start_and_leaves_no_loop(llama_dir: Path) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler")

    engine = AsyncEngine(make_engine(llama_dir))
    with pytest.raises(RuntimeError, match="no compiler"):
        engine.start(warm_up=broken)
    assert not engine.alive
