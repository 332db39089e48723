"""The index of benchmarks/published/: one row per published result, read from its JSON (date,
host CPU when the run recorded it, the command for serving runs, and each system's output
tokens/s per load level), so the performance history is the data itself."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

PUBLISHED = Path(__file__).resolve().parents[2] / "benchmarks" / "published"
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
_LOCAL_ARGS = {"--out-dir", "--tag"}  # where a run wrote its files: not part of what it measured


def render_published() -> str:
    lines = ["| result | date | host CPU | command | output tok/s per system (c = ...) |"]
    lines.append("|---|---|---|---|---|")
    for path in sorted(PUBLISHED.glob("*.json"), key=lambda p: (_date(p), p.name)):
        doc = json.loads(path.read_text())
        doc = doc if isinstance(doc, dict) else {}
        plot = " ([plot](../assets/published/{}))".format(path.with_suffix(".png").name)
        shown = f"`{path.name}`{plot if path.with_suffix('.png').exists() else ''}"
        lines.append(
            f"| {shown} | {_date(path)} | {_host(doc)} | {_command(doc)} | {_throughput(doc)} |"
        )
    return "\n".join(lines)


def _date(path: Path) -> str:
    match = _DATE.search(path.name)
    return match.group(1) if match else "-"


def _host(doc: dict[str, Any]) -> str:
    machine = doc.get("machine")
    cpu = machine.get("cpu") if isinstance(machine, dict) else machine
    cpu = cpu or doc.get("host_cpu") or doc.get("host")
    gpu = machine.get("gpu") if isinstance(machine, dict) else None
    host = f"{cpu}, GPU: {gpu}" if cpu and gpu else cpu or (f"GPU: {gpu}" if gpu else None)
    return str(host).replace("|", "\\|") if host else "not recorded"


def _command(doc: dict[str, Any]) -> str:
    argv = doc.get("argv")
    if not isinstance(argv, list) or doc.get("benchmark") not in ("serve", "structured"):
        command = doc.get("command")  # other benchmarks record their own command line
        return f"`{command}`".replace("|", "\\|") if isinstance(command, str) else "-"
    command = reproducing_command("benchmarks.serve", [str(arg) for arg in argv], _LOCAL_ARGS)
    return f"`{command}`".replace("|", "\\|")


def reproducing_command(module: str, argv: Sequence[str], local_flags: Collection[str]) -> str:
    """`python -m <module> <argv>` less each of `local_flags` and its value (`--flag value` or
    `--flag=value`): what reproduces a run, without the flags that only say where it wrote (the
    benchmarks record this in their JSON; runs that recorded only their argv get it here)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in local_flags:
            skip = True
        elif arg.split("=", 1)[0] not in local_flags:
            kept.append(arg)
    return shlex.join(["python", "-m", module, *kept])


def _throughput(doc: dict[str, Any]) -> str:
    systems = doc.get("systems")
    if not isinstance(systems, dict):
        return "-"
    parts = []
    for name, system in systems.items():
        runs = [r for r in system.get("runs", []) if "output_throughput" in r.get("metrics", {})]
        if not runs:
            continue
        levels = " / ".join(f"{r['x']:g}" for r in runs)
        figures = " / ".join(f"{r['metrics']['output_throughput']:.1f}" for r in runs)
        parts.append(f"{name}: {figures} (c = {levels})")
    return "<br>".join(parts) or "-"
