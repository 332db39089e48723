"""The GPU kit runs end to end on the CPU at tiny size, so it never rots between GPU sessions."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu_kit


def test_kit_runs_every_step_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "kit"
    rc = gpu_kit.main(
        ["--out", str(out), "--device", "cpu", "--shapes", "tiny", "--concurrency", "1,2"]
        + ["--num-requests", "4", "--output-tokens", "4,8", "--rows", "4", "--no-compile"]
        + ["--tests", "tests/test_detokenizer.py", "--budget", "400"]
    )
    kit = json.loads((out / "kit.json").read_text())
    assert rc == 0, kit
    assert [s["step"] for s in kit["steps"]] == [
        "tests",
        "tiny: build",
        "tiny: engine overhead",
        "tiny: serve",
    ]
    assert all(s["rc"] == 0 for s in kit["steps"])
    assert 'failures="0"' in (out / "tests.xml").read_text()
    overhead = json.loads((out / "overhead-tiny.json").read_text())
    assert {r["kind"] for r in overhead} == {"greedy", "sampled", "beam"}
    serve = json.loads((out / "serve-tiny.json").read_text())
    text = json.dumps(serve)
    assert "beamline" in text and "hf-static" in text  # the baseline ran in the same run
    assert (out / "serve-tiny.png").stat().st_size > 0
    assert not list(out.glob("**/*.safetensors"))  # models stay out of what travels back
