"""`python -m benchmarks.serve`: the serving benchmark (flags: `--help`, benchmarks/README.md).

`main(argv)` runs, in order, the system under test, each `--compare-beamline` variant and the
baselines on one workload, the JSON rewritten after every measured point, then prints the report
and draws the plot; or one single-server case (`--structured`, `--beam-case`). The parts are in
benchmarks/serving/: options.py, systems.py, baselines.py, results.py, report.py, plot.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.launch import LaunchError
from benchmarks.machine import machine_info
from benchmarks.serving.baselines import run_baselines
from benchmarks.serving.beam_case import format_beam_case
from benchmarks.serving.options import build_workload, resolve_args
from benchmarks.serving.plot import plot_results
from benchmarks.serving.report import SystemResult, format_report, write_json
from benchmarks.serving.results import Progress, result_paths
from benchmarks.serving.structured import format_structured
from benchmarks.serving.systems import measure_server, measure_variants
from benchmarks.workload import Workload


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    workload = build_workload(args)
    if args.structured or args.beam_case:
        return measure_one_case(args, workload, argv)
    progress = Progress(args, workload, argv)
    progress.write()

    def on_ours(result: SystemResult) -> None:
        progress.ours = result
        progress.write()

    started_all = True
    try:
        measured, progress.server = measure_server(args, workload, on_ours)
        assert isinstance(measured, SystemResult)
        progress.ours = measured
    except LaunchError as exc:
        print(f"benchmarks.serve: could not start beamline: {exc}", file=sys.stderr)
        progress.skipped[args.label] = f"could not start beamline: {exc}"
        started_all = False
    progress.phases["system_under_test"] = time.time() - progress.started
    t0 = time.time()
    started_all &= measure_variants(args, workload, progress)
    if args.variants:
        progress.phases["compared_beamlines"] = time.time() - t0
    run_baselines(args, workload, progress)
    doc = progress.write(complete=True)
    if doc["plot"] is not None:
        plot_results(doc, progress.png_path)
    print(format_report(doc))
    print(f"\nwrote {progress.json_path}" + (f"\nwrote {doc['plot']}" if doc["plot"] else ""))
    if not started_all:
        return 2
    servers = ([progress.ours] if progress.ours else []) + [
        s for s in progress.others if s.kind == "server-variant"
    ]
    errors = sum(r.metrics["errors"] for s in servers for r in s.runs)
    return 1 if errors else 0


def measure_one_case(args: argparse.Namespace, workload: Workload, argv: list[str] | None) -> int:
    """--structured or --beam-case: one server, one JSON at the end."""
    started = time.time()
    machine = machine_info()
    try:
        measured, server_info = measure_server(args, workload)
    except LaunchError as exc:
        print(f"benchmarks.serve: could not start beamline: {exc}", file=sys.stderr)
        return 2
    common = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine,
        "server": server_info,
    }
    if args.structured:
        json_path, _ = result_paths(args, "structured")
        write_json({"benchmark": "structured", **common, "structured": measured}, json_path)
        print(format_structured(measured))
        print(f"\nwrote {json_path}")
        return 0 if not any(sum(r["errors"]) for r in measured["runs"]) else 1
    json_path, _ = result_paths(args, "beam")
    write_json({"benchmark": "beam-case", **common, "beam_case": measured}, json_path)
    print(format_beam_case(measured))
    print(f"\nwrote {json_path}")
    return 0 if measured["greedy"]["status"] == 200 and measured["beam"]["status"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
