"""The row-tensors benchmark runs (tiny sizes), checks every way against a rebuild, reports all."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import row_tensors


def test_row_tensors_times_every_way_with_requests_joining_and_leaving(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    results = row_tensors.main(
        ["--rows", "3,8", "--kinds", "greedy,sampled", "--vocab", "300", "--steps", "4"]
        + ["--out", str(out)]
    )
    assert [(r.kind, r.rows) for r in results] == [
        ("greedy", 3),
        ("greedy", 8),
        ("sampled", 3),
        ("sampled", 8),
    ]
    for r in results:
        assert r.ms.keys() == {"rebuild", "records", "steady"} and min(r.ms.values()) > 0
        assert r.rebuild_per_records == r.ms["rebuild"] / r.ms["records"]
    assert len(json.loads(out.read_text())) == 4
    only = row_tensors.main(["--rows", "4", "--kinds", "sampled", "--ways", "rebuild"])
    assert only[0].ms.keys() == {"rebuild"} and only[0].rebuild_per_records is None
