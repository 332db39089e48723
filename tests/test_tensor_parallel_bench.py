"""`python -m benchmarks.tensor_parallel` at toy size (two ranks against one, the broadcast timed
inside each step), and the per-step volume it computes, against the arithmetic by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks import tensor_parallel

pytestmark = pytest.mark.timeout(300)


def test_the_volume_of_a_llama_8b_step_at_256_rows_over_two_ranks() -> None:
    v = tensor_parallel.step_volume(4096, 32, 128256, ranks=2, rows=256, context=1024)
    one_reduce = 256 * 4096 * 2  # rows x hidden, bf16
    assert v.all_reduce_bytes == 65 * one_reduce  # 2 per layer + the embedding, ring: 2 (N-1)/N
    assert v.logits_bytes == 256 * 128256 * 2 // 2  # the follower's half of the bf16 logits
    assert v.inputs_bytes == 4 * (6 + 256 * (10 + 1 + 64))  # 64 blocks of 16 tokens a row
    assert round(v.total_mib, 2) == 161.39
    more = tensor_parallel.step_volume(4096, 32, 128256, ranks=8, rows=256, context=1024)
    assert more.all_reduce_bytes == 65 * 2 * 7 * one_reduce // 8


@pytest.fixture
def restored_threads() -> Iterator[None]:
    """The benchmark's process is the driver, and a driver of 2 ranks on the CPU takes half the
    cores for itself: this test's process gets its thread count back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("restored_threads")
def test_the_benchmark_times_both_sizes_eager_and_compiled(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    args = ["--model", str(llama_dir), "--rows", "1,2", "--steps", "4", "--out", str(out)]
    assert tensor_parallel.main(args) == 0
    result = json.loads(out.read_text())
    measured = {(m["ranks"], m["compiled"], m["rows"]): m for m in result["measured"]}
    assert set(measured) == {(n, c, r) for n in (1, 2) for c in (False, True) for r in (1, 2)}
    assert all(m["broadcast_ms_p50"] == 0 for (ranks, _, _), m in measured.items() if ranks == 1)
    assert all(m["broadcast_ms_p50"] > 0 for (ranks, _, _), m in measured.items() if ranks == 2)
    # every timed step of a compiled setup ran the compiled graph, two ranks' all-reduces in it
    assert all(m["compiled_steps"] == (4 if c else 0) for (_, c, _), m in measured.items())
    ratio = result["step_time_ratio_vs_first_setup"]["2_ranks_eager_2_rows"]
    assert ratio == measured[(2, False, 2)]["step_ms_p50"] / measured[(1, False, 2)]["step_ms_p50"]
    versus = result["step_time_compiled_vs_eager"]["2_ranks_1_rows"]
    assert versus == measured[(2, True, 1)]["step_ms_p50"] / measured[(2, False, 1)]["step_ms_p50"]
    assert [v["ranks"] for v in result["volume"]["per_step"]] == [2, 4, 8]
