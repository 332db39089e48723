"""`python -m benchmarks.two_models` end to end at toy size: one server serving two models
against two one-model servers (with torch's threads and with the cores shared out), both models
loaded at once, and a JSON whose ratios come from what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import two_models
from tests.tiny_models import build_tiny_model


def test_the_benchmark_runs_and_reports_its_ratios(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    root = tmp_path_factory.mktemp("two_models_bench")
    main = build_tiny_model(root / "main", "llama", seed=0)
    second = build_tiny_model(root / "second", "llama", seed=1)
    out = tmp_path / "two.json"
    code = two_models.main(
        [
            "--model", str(main), "--second", str(second), "--concurrency", "4",
            "--num-requests", "2", "--rounds", "1", "--out-dir", str(tmp_path), "--out", str(out),
            "--launch-timeout", "120", "--beamline-args", "--num-kv-blocks 256 --dtype float32",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    configs = ("one_server", "two_servers", "two_servers_shared_cores")
    for key in configs:
        level = result["results"][key]["levels"]["c4"]
        for half in level["rounds"][0]["per_model"]:  # both models answered every request
            assert half["completed"] == 2 and half["errors"] == 0
        assert result["results"][key]["pss_bytes"] > 0
    one = result["results"]["one_server"]["levels"]["c4"]
    assert [h["model"] for h in one["rounds"][0]["per_model"]] == ["main", "second"]
    summary = result["summary"]["c4"]
    baseline = result["results"][summary["baseline"]]
    assert summary["one_over_two_throughput"] == pytest.approx(
        one["median_output_throughput"] / baseline["levels"]["c4"]["median_output_throughput"]
    )
    assert summary["one_over_two_memory"] == pytest.approx(
        result["results"]["one_server"]["pss_bytes"] / baseline["pss_bytes"]
    )
