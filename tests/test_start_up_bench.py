"""benchmarks.start_up: which starts it times, in which order, and what it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import start_up


def test_start_up_converts_once_empties_the_compiled_cache_once_and_alternates_the_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    (cache / "compiled" / "stale").mkdir(parents=True)
    starts: list[tuple[list[str], bool]] = []
    seconds = iter([50.0, 100.0, 20.0, 24.0, 21.0, 25.0])

    def fake_start(model: str | None, cache_dir: Path, args: list[str], log: Path) -> float:
        assert cache_dir == cache
        starts.append((args, (cache / "compiled").exists()))
        return next(seconds)

    monkeypatch.setattr(start_up, "time_start", fake_start)
    out = tmp_path / "start_up.json"
    argv = ["--runs", "2", "--cache-dir", str(cache), "--out", str(out)]
    argv += ["--args", "--quantization w8a8 --torch-compile"]
    assert start_up.main(argv) == 0
    plain = ["--quantization", "w8a8", "--no-torch-compile"]
    compiled = ["--quantization", "w8a8", "--torch-compile"]
    assert starts == [
        (plain, True),  # converts the model; the stale entry is still there
        (compiled, False),  # the first compiled start finds nothing compiled
        (plain, False),
        (compiled, False),
        (plain, False),
        (compiled, False),
    ]
    result = json.loads(out.read_text())
    assert result["converting_start_s"] == 50.0  # the first start, which converted the model
    assert result["first_compiled_s"] == 100.0
    assert result["plain_s"] == [20.0, 21.0]
    assert result["later_compiled_s"] == [24.0, 25.0]
    assert "later compiled / plain start (medians): 1.20x" in capsys.readouterr().out
