"""`python -m benchmarks.lm_fusion` end to end at toy size: one server with an extra model, the
plain and the fused beam loads per round, the companion served alone, and a JSON whose ratios
come from what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import lm_fusion
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fusion_bench")
    return build_tiny_model(root / "main", "llama"), build_tiny_model(root / "lm", "llama", seed=1)


def test_the_benchmark_runs_and_reports_its_ratios(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    main, lm = model_dirs
    out = tmp_path / "fusion.json"
    code = lm_fusion.main(
        [
            "--model", str(main), "--companion", str(lm), "--concurrency", "1,2",
            "--num-requests", "2", "--rounds", "1", "--num-beams", "2",
            "--out-dir", str(tmp_path), "--out", str(out), "--launch-timeout", "120",
            "--beamline-args", "--num-kv-blocks 256 --dtype float32",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["rounds"]] == [1, 2]
    for r in result["rounds"]:
        for kind in ("plain", "fused"):
            assert r[kind]["completed"] == 2 and r[kind]["errors"] == 0
    for c in ("1", "2"):
        alone = result["companion_alone"][c]["seconds"]
        plain = result["rounds"][int(c) - 1]["plain"]["seconds"]
        s = result["summary"][f"c{c}"]
        assert s["companion_cost_ratio"] == pytest.approx(alone / plain)
        assert s["goal_at_most"] == pytest.approx(1.1 * (1 + alone / plain))
    assert "--extra-models" in result["server_args"]
