"""benchmarks.start_up: which starts it times, in which order, and what it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import start_up
from benchmarks.start_up import Start


def test_start_up_starts_fresh_then_alternates_plain_later_and_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    starts: list[tuple[str, list[str]]] = []
    beamline = iter(
        [
            Start(20.0, 21.0, 90.0),  # fresh: converted, compiled while serving
            Start(9.0, 10.0, None),
            Start(8.0, 9.0, 12.0),
            Start(11.0, 12.0, None),
            Start(8.5, 9.5, 14.0),
        ]
    )
    peer = iter([Start(1.0, 2.0, None), Start(1.5, 2.5, None)])

    def fake_start(model: str | None, cache_dir: Path, args: list[str], log: Path) -> Start:
        assert cache_dir == cache
        starts.append(("beamline", args))
        return next(beamline)

    def fake_peer(gguf: Path, log: Path) -> Start:
        assert gguf == tmp_path / "model.gguf"
        starts.append(("llama-server", []))
        return next(peer)

    monkeypatch.setattr(start_up, "time_start", fake_start)
    monkeypatch.setattr(start_up, "time_llama_server", fake_peer)
    out = tmp_path / "start_up.json"
    argv = ["--runs", "2", "--cache-dir", str(cache), "--out", str(out)]
    argv += ["--args", "--quantization w8a8", "--gguf", str(tmp_path / "model.gguf")]
    assert start_up.main(argv) == 0
    plain = ["--quantization", "w8a8", "--no-torch-compile"]
    compiled = ["--quantization", "w8a8"]
    assert starts == [
        ("beamline", compiled),  # fresh
        ("beamline", plain),
        ("beamline", compiled),
        ("llama-server", []),
        ("beamline", plain),
        ("beamline", compiled),
        ("llama-server", []),
    ]
    result = json.loads(out.read_text())
    assert result["fresh"] == {"healthy_s": 20.0, "answered_s": 21.0, "compiled_s": 90.0}
    assert [s["answered_s"] for s in result["plain"]] == [10.0, 12.0]
    assert [s["compiled_s"] for s in result["later"]] == [12.0, 14.0]
    assert [s["answered_s"] for s in result["llama_server"]] == [2.0, 2.5]
    printed = capsys.readouterr().out
    assert "| later: --quantization w8a8 | 2 | 8.2 | 9.2 | 13.0 |" in printed  # medians
    assert "| plain: --quantization w8a8 --no-torch-compile | 2 | 10.0 | 11.0 | - |" in printed


def test_the_fresh_start_needs_an_empty_cache(tmp_path: Path) -> None:
    (tmp_path / "compiled").mkdir()
    with pytest.raises(SystemExit):
        start_up.main(["--cache-dir", str(tmp_path), "--no-llama-server"])
