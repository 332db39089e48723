"""The serving benchmark's baselines. HF `generate()` static batching runs each concurrency
level's first batch once untimed before timing the level, so the timed batches carry no one-time
costs of that batch shape (on an H200 the first timed batch of 16 took about 12 s, the second
about 3 s). Recorded peer figures are drawn only beside a run in their setting."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from benchmarks.serving import baselines, hf_baseline
from benchmarks.workload import BenchRequest


def test_each_level_is_warmed_with_its_own_first_batch_before_it_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[int]]] = []
    model = SimpleNamespace(path="m", dtype="bfloat16", load_s=0.0)

    def generate(hf: object, batch: Sequence[BenchRequest], ignore_eos: bool) -> list:
        calls.append(("generate", [r.index for r in batch]))
        return []

    def timed(hf: object, requests: Sequence[BenchRequest], size: int, *_: object) -> tuple:
        calls.append((f"timed b={size}", [r.index for r in requests]))
        return [], 1.0

    monkeypatch.setattr(hf_baseline, "load_hf_model", lambda *a, **k: model)
    monkeypatch.setattr(hf_baseline, "_generate", generate)
    monkeypatch.setattr(hf_baseline, "run_static_batches", timed)
    monkeypatch.setattr(baselines, "summarize", lambda res, dur: {"duration_s": dur})
    requests = [BenchRequest(i, f"prompt {i}", 8) for i in range(40)]
    args = argparse.Namespace(
        baseline_names=["hf-static"], mode="concurrency", model="m", hf_dtype="bfloat16",
        device="cpu", levels=["4", "16"], rounds=2, ignore_eos=True,
    )  # fmt: skip
    added: list[object] = []
    progress = SimpleNamespace(phases={}, skipped={}, add=added.append)
    baselines.run_baselines(args, SimpleNamespace(requests=requests), progress)  # type: ignore[arg-type]
    assert calls == [
        ("generate", [-1]),  # the tiny first generate(): loading's one-time costs
        ("generate", [0, 1, 2, 3]),  # c = 4's first batch, untimed
        ("timed b=4", list(range(8))),
        ("generate", list(range(16))),  # c = 16's
        ("timed b=16", list(range(32))),
    ]


def test_recorded_peers_are_drawn_only_beside_a_run_in_their_setting() -> None:
    """The CPU peers' recorded figures (default model, default workload) are drawn beside a run in
    that setting only, at its levels: a GPU run of another model drew them among its own lines."""
    from benchmarks.serving.plot import plotted_peers

    peers = [
        {"system": "llama-server", "concurrency": c, "output_throughput": t, "comparable": True}
        for c, t in ((1, 50.0), (16, 120.0), (64, 130.0))
    ]
    doc = {"recorded_peers": peers}
    assert [p["concurrency"] for p in plotted_peers(doc, [1, 16])["llama-server"]] == [1, 16]
    doc = {"recorded_peers": [{**p, "comparable": False} for p in peers]}
    assert plotted_peers(doc, [1, 16]) == {}
