"""The graph-inputs benchmark runs (small sizes) and reports one figure per row count."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import graph_inputs


def test_graph_inputs_reports_every_row_count(tmp_path: Path) -> None:
    out = tmp_path / "inputs.json"
    results = graph_inputs.main(
        ["--rows", "2,8", "--context", "64", "--max-model-len", "4096", "--repeats", "3"]
        + ["--threads", "0", "--out", str(out)]  # in process: torch's threads stay as they are
    )
    assert [r["rows"] for r in results] == [2, 8]
    assert all(r["ms"] > 0 for r in results)
    assert json.loads(out.read_text()) == results
