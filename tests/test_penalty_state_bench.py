"""The penalty-state benchmark runs (tiny sizes), checks both ways agree, and reports both."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import penalty_state


def test_penalty_state_times_both_ways_on_the_same_scores(tmp_path: Path) -> None:
    out = tmp_path / "penalties.json"
    results = penalty_state.main(
        ["--rows", "4", "--history", "20,90", "--vocab", "300", "--steps", "3", "--out", str(out)]
    )
    assert [(r.rows, r.history, r.steps) for r in results] == [(4, 20, 3), (4, 90, 3)]
    for r in results:
        assert r.lists_ms > 0 and r.table_ms > 0
        assert abs(r.lists_per_table - r.lists_ms / r.table_ms) < 1e-9
    assert [row["history"] for row in json.loads(out.read_text())] == [20, 90]
