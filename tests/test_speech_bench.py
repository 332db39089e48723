"""`python -m benchmarks.speech` at its smallest: one espeak-ng clip, one client, beamline and one
faster-whisper setting on the PyPI tiny.en, its JSON written with every system's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import speech, speech_clips
from tests.audio_files import espeak_wav


def test_the_clips_span_five_to_thirty_seconds_of_speech() -> None:
    texts = speech_clips.clip_texts(7)
    assert [text.count(".") for text in texts] == [1, 2, 3, 4, 5, 6, 7]
    assert texts[1].startswith(speech_clips.SENTENCES[3])
    assert speech_clips.word_error_rate(["the quick brown fox"], ["The quick brown fox!"]) == 0.0


@pytest.mark.timeout(300)
def test_a_short_run_writes_both_systems(tmp_path: Path) -> None:
    espeak_wav("check")  # fails in CI, skips elsewhere, without espeak-ng
    argv = ["--concurrency", "1", "--clips", "1", "--repeats", "1", "--faster-whisper", "int8"]
    assert speech.main([*argv, "--out-dir", str(tmp_path), "--tag", "short"]) == 0
    doc = json.loads((tmp_path / "short.json").read_text())
    assert doc["benchmark"] == "speech" and doc["command"].startswith("python -m benchmarks.speech")
    level = doc["levels"]["1"]
    assert set(level["systems"]) == {"beamline", "faster-whisper int8"}
    for entry in level["systems"].values():
        assert entry["audio_s_per_s"] > 0 and entry["wer"] <= 0.5
    assert level["ratio_vs_best_faster_whisper"] > 0
    assert 2 < doc["clips"][0]["seconds"] < 10
