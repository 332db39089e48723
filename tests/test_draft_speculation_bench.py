"""`python -m benchmarks.draft_speculation` end to end at toy size: three servers (no drafts,
n-gram drafts, a draft model), the same greedy load on each per round, and a JSON whose ratios
come from what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import draft_speculation
from tests.tiny_models import build_tiny_model


def test_the_benchmark_runs_and_reports_its_ratios(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    main = build_tiny_model(tmp_path_factory.mktemp("draft_bench") / "main", "llama")
    out = tmp_path / "draft.json"
    code = draft_speculation.main(
        [
            "--model", str(main), "--concurrency", "1,2", "--num-requests", "2",
            "--rounds", "1", "--out-dir", str(tmp_path), "--out", str(out),
            "--launch-timeout", "120", "--beamline-args", "--num-kv-blocks 256 --dtype float32",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["rounds"]] == [1, 2]
    for r in result["rounds"]:
        for mode in draft_speculation.MODES:
            assert r[mode]["completed"] == 2 and r[mode]["errors"] == 0
    for c, r in zip((1, 2), result["rounds"]):
        s = result["summary"][f"c{c}"]
        assert s["draft_over_none_time"] == pytest.approx(
            r["draft"]["seconds"] / r["none"]["seconds"]
        )
        assert s["ngram_over_none_time"] == pytest.approx(
            r["ngram"]["seconds"] / r["none"]["seconds"]
        )
    drafts = result["drafts"]
    assert drafts["none"] == {"drafted": 0, "accepted": 0}
    # the draft model is the served one: every greedy draft is accepted
    assert drafts["draft"]["accepted"] == drafts["draft"]["drafted"] > 0
    assert "--speculative-model" in result["server_args"]["draft"]
