"""The engine-overhead benchmark runs (tiny sizes) and reports what it says it does."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import engine_overhead
from benchmarks.random_models import SHAPES, build_random_model, word_of


def test_engine_overhead_reports_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    results = engine_overhead.main(
        ["--rows", "4,8", "--kinds", "greedy,sampled,beam", "--steps", "3", "--out", str(out)]
    )
    assert [(r.kind, r.rows) for r in results] == [
        (kind, rows) for kind in ("greedy", "sampled", "beam") for rows in (4, 8)
    ]
    for r in results:
        assert r.steps == 3
        assert 0 < r.forward_ms < r.step_ms  # the forward was timed, and inside the step
        assert r.host_ms > 0
    assert [row["kind"] for row in json.loads(out.read_text())] == [r.kind for r in results]


def test_engine_overhead_reports_the_text_rendered_during_the_forward() -> None:
    results = engine_overhead.main(
        ["--rows", "8", "--kinds", "greedy,beam", "--steps", "3", "--overlap-outputs"]
    )
    greedy, beam = results
    assert 0 < greedy.render_ms < greedy.host_ms  # streamed rows render text in the window
    assert 0 < greedy.exposed_ms < greedy.host_ms
    assert beam.render_ms < 0.05  # beams stream nothing per step: nothing to render


def test_engine_overhead_runs_with_async_scheduling_and_times_free_steps() -> None:
    (greedy,) = engine_overhead.main(
        ["--rows", "8", "--kinds", "greedy", "--steps", "3", "--async-scheduling"]
    )
    assert 0 < greedy.forward_ms < greedy.free_step_ms  # on the CPU the forward holds the host
    assert greedy.step_per_forward == greedy.free_step_ms / greedy.forward_ms > 1


def test_random_model_has_the_shape_and_a_tokenizer_for_every_id(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = build_random_model(tmp_path / "tiny", "tiny")
    config = AutoConfig.from_pretrained(path)
    assert config.hidden_size == SHAPES["tiny"]["hidden_size"]
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == config.vocab_size
    words = [word_of(i) for i in (300, 301)]
    assert tok.decode([300, 301]) == " " + " ".join(words)
    assert tok(" ".join(words)).input_ids == [300, 301]
