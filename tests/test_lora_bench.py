"""`python -m benchmarks.lora` end to end at toy size: adapters made, one server with them, both
loads per round, the plain server, and a JSON whose ratios come from what it measured."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import lora
from benchmarks.workload import BenchRequest


def test_requests_are_spread_over_the_adapters_in_turn() -> None:
    target = lora.SpreadTarget("http://x", "base", models=("a", "b"))
    models = [target.body(BenchRequest(i, "hi", 4))["model"] for i in range(4)]
    assert models == ["a", "b", "a", "b"]


def test_the_benchmark_runs_and_reports_its_ratios(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    code = lora.main(
        [
            "--model", str(llama_dir), "--adapters", "2", "--rank", "4", "--concurrency", "2",
            "--num-requests", "4", "--rounds", "1", "--plain", "--cache", str(tmp_path / "cache"),
            "--out-dir", str(tmp_path), "--out", str(out), "--launch-timeout", "120",
            "--beamline-args", "--num-kv-blocks 128 --dtype float32",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    (round0,) = result["rounds"]
    for kind in ("base", "adapters"):
        assert round0[kind]["completed"] == 4 and round0[kind]["errors"] == 0
    s = result["summary"]
    assert s["step_time_ratio"] == s["adapters_tpot_p50_ms"] / s["base_tpot_p50_ms"] > 0
    assert result["no_lora"]["completed"] == 4
    assert result["device_mib_per_resident_adapter"] > 0
    assert (tmp_path / "cache" / "llama-r4" / "adapter1" / "adapter_model.safetensors").is_file()
