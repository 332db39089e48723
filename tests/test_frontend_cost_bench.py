"""The front-end cost benchmark runs at a tiny size and reports sane, complete figures."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from benchmarks import frontend_cost
from benchmarks.frontend.cpu import ENGINE, EVENT_LOOP, WORKERS, ThreadSample, cpu_split


def test_frontend_cost_reports_every_mode_with_counters_and_cpu(tmp_path: Path) -> None:
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    # One torch thread: with two, a busy CI machine oversubscribes the cores and a step of the
    # tiny model can take 100x longer (see the module docstring).
    report = frontend_cost.main(
        [
            "--requests", "16", "--max-tokens", "8", "--concurrency", "8",
            "--server-args", "--num-threads 1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert json.loads((tmp_path / "frontend_cost.json").read_text()) == json.loads(
        json.dumps(report)
    )
    assert torch.get_num_threads() == threads  # left as found; so is an unfrozen collector
    assert gc.get_freeze_count() == 0 or frozen > 0  # (an earlier test may have frozen it)
    results = {r["mode"]: r for r in report["results"] if r["concurrency"] == 8}
    assert set(results) == {
        "in-process",
        "http-stream",
        "http-nonstream",
        "http-stream+process",  # the same server with --engine-process on, in the same run
        "http-nonstream+process",
    }
    for mode, r in results.items():
        assert r["ok"] == r["requests"] == 16, r["errors"]
        assert r["output_tokens"] == 16 * 8
        assert r["out_tok_s"] > 0 and r["steps_per_s"] > 0
        assert 0 < r["in_steps"] <= 1.05  # the engine's own busy_seconds over the run's wall
        assert 1 <= r["rows_per_step"] <= 8
        assert r["steps"] >= 16 * 8 / 8  # at most 8 rows sample per step
        assert sum(r["tokens_per_step"].values()) == r["steps"]
        cpu = r["server_cpu"]
        assert cpu["groups_cpu_s"][ENGINE] > 0, cpu  # the engine thread was found and worked
        names = {t["name"] for t in cpu["threads"]}
        assert ("engine process" in names) == mode.endswith("+process"), names
        assert cpu["engine_thread_time"]["on_cpu"] > 0
        assert all("name" in t and t["cpu_s"] >= 0 for t in cpu["threads"])
        if mode == "in-process":
            assert r["step_ms_mean"] > 0 and r["rows_per_step_exact"] is not None
            assert abs(r["rows_per_step_exact"] - r["rows_per_step"]) < 1.0
            assert abs(r["frontend_share"]) < 1  # only the step model's fit error
        else:
            assert EVENT_LOOP in cpu["groups_cpu_s"]
            # read in clock ticks (10 ms): so short a run's client may take none
            assert r["client_cpu_s"] >= 0
            assert r["client_cores"] == pytest.approx(r["client_cpu_s"] / r["wall_s"])
            assert r["frontend_share"] is not None and r["frontend_share"] < 1
            assert 0 < r["rows_ratio"] <= 1.5
            assert r["cpu_share_low"] <= r["cpu_share_high"] < 1  # the event loop's CPU added
            assert r["others_cores"] is not None
        assert r["engine_alone_s"] > 0 and r["frontend_share"] < 1
    assert "front-end share" in report["verdict"]
    model = report["step_model"]
    assert model["num_steps"] >= 3 * 16 and len(model["anchors"]) == 3


def test_cpu_split_attributes_threads_and_the_engine_threads_wall_time() -> None:
    before = {1: ThreadSample("python", 1.0, 1.0, 0.0), 2: ThreadSample("eng", 2.0, 2.0, 0.5)}
    after = {
        1: ThreadSample("python", 1.5, 1.5, 0.0),
        2: ThreadSample("eng", 3.0, 3.0, 1.0),
        3: ThreadSample("eng", 0.2, 0.2, 0.0),  # started during the window
    }
    groups = {1: EVENT_LOOP, 2: ENGINE, 3: WORKERS}
    split = cpu_split(before, after, 1.7, 2.0, lambda tid, comm: (comm, groups[tid]))
    assert split["groups_cpu_s"][ENGINE] == 1.0
    assert split["groups_cpu_s"][EVENT_LOOP] == 0.5
    assert abs(split["groups_cpu_s"][WORKERS] - 0.2) < 1e-9
    assert split["engine_thread_time"] == {"on_cpu": 0.5, "runqueue": 0.25, "off_cpu": 0.25}
    assert split["process_cores"] == 0.85
