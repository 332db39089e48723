"""The serve JSON while the run goes on (`Progress`, rewritten after every measured point) and
where a run writes its files."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from benchmarks.machine import machine_info
from benchmarks.serving.options import peers_comparable
from benchmarks.serving.report import RECORDED_NOTE, SystemResult, peer_rows, ratio_rows, write_json
from benchmarks.workload import Workload


def result_paths(args: argparse.Namespace, kind: str) -> tuple[Path, Path]:
    stem = args.tag or f"{kind}{'-short' if args.short else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    return args.out_dir / f"{stem}.json", args.out_dir / f"{stem}.png"


def server_log_path(args: argparse.Namespace) -> Path:
    return args.out_dir / "beamline-server.log"


class Progress:
    """The serve JSON, rewritten after every measured point (each level of each system): a run
    cut short (a GPU command's time limit, a crash) keeps what it measured, a beamline that does
    not start is listed under `skipped` with the reason, and `complete` says whether the run
    reached its end."""

    def __init__(
        self, args: argparse.Namespace, workload: Workload, argv: list[str] | None
    ) -> None:
        self.args = args
        self.workload = workload
        self.argv = sys.argv[1:] if argv is None else argv
        self.started = time.time()
        self.machine = machine_info()
        self.server: dict = {}
        self.ours: SystemResult | None = None
        self.others: list[SystemResult] = []  # the --compare-beamline variants, then baselines
        self.skipped: dict[str, str] = {}
        self.phases: dict[str, float] = {}
        self.json_path, self.png_path = result_paths(args, "serve")

    def add(self, result: SystemResult) -> None:
        """Record a point of `result` (a system seen for the first time joins the others)."""
        if result is not self.ours and not any(result is r for r in self.others):
            self.others.append(result)
        self.write()

    def doc(self, complete: bool) -> dict:
        args = self.args
        ours = self.ours or SystemResult(args.label, args.label, "server")  # it never started
        systems = ([self.ours] if self.ours else []) + self.others
        return {
            "benchmark": "serve",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started)),
            "argv": self.argv,
            "machine": self.machine,
            "server": self.server,
            "mode": args.mode,
            "short": args.short,
            "ignore_eos": args.ignore_eos,
            "workload": self.workload.describe(),
            "system_under_test": ours.name,
            "systems": {s.name: s.to_dict() for s in systems},
            "ratios": ratio_rows(ours, self.others),
            "recorded_peers": peer_rows(ours, args.mode, peers_comparable(args)),
            "recorded_note": RECORDED_NOTE,
            "skipped": self.skipped,
            "duration_s": time.time() - self.started,
            "phase_seconds": self.phases,
            "plot": str(self.png_path) if plotting_available() else None,
            "complete": complete,
        }

    def write(self, complete: bool = False) -> dict:
        doc = self.doc(complete)
        write_json(doc, self.json_path)
        return doc


def plotting_available() -> bool:
    """matplotlib may be missing where the wheels are few (a GPU machine): the plot is then drawn
    later from the JSON (`benchmarks.serving.plot.plot_results`)."""
    return importlib.util.find_spec("matplotlib") is not None
