"""Each step's headline figures for kit.json: test counts and failures, host ms per step, out
tok/s and TTFT / TPOT p50 per system and concurrency."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.kit.steps import Step


def summarize_tests(xml: Path, log: Path) -> dict:
    """Counts and failures from the JUnit report, or from pytest's -v lines if it has none."""
    failed: list[str] = []
    if xml.exists():
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        counts = {
            key: sum(int(s.get(key, 0)) for s in suites)
            for key in ("tests", "failures", "errors", "skipped")
        }
        for case in root.iter("testcase"):
            for bad in case:
                if bad.tag in ("failure", "error"):
                    message = (bad.get("message") or "").strip().split("\n")[0][:300]
                    failed.append(f"{case.get('classname')}::{case.get('name')}: {message}")
        return {**counts, "failed": failed[:50], "source": "tests.xml"}
    outcomes: dict[str, int] = {}
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for parts in (line.split() for line in lines):
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in PYTEST_OUTCOMES:
            outcomes[parts[1].lower()] = outcomes.get(parts[1].lower(), 0) + 1
            if parts[1] in ("FAILED", "ERROR"):
                failed.append(parts[0])
    return {**outcomes, "failed": failed[:50], "source": "tests.log (no report: cut short)"}


PYTEST_OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")

# engine_overhead's headline: host ms per step, and what a step costs against its forward
OVERHEAD_KEYS = "kind rows path host_ms forward_ms step_ms free_step_ms step_per_forward".split()


def summarize_overhead(path: Path) -> list[dict]:
    return [
        {k: round(row[k], 3) if isinstance(row[k], float) else row[k] for k in OVERHEAD_KEYS}
        for row in json.loads(path.read_text())
    ]


def summarize_serve(path: Path) -> dict:
    doc = json.loads(path.read_text())
    per_system: dict[str, dict] = {}
    for name, system in doc["systems"].items():
        runs = {f"{run['x']:g}": run["metrics"] for run in system["runs"]}
        per_system[name] = {
            "out_tok_s": {x: round(m["output_throughput"], 1) for x, m in runs.items()},
            "ttft_p50_ms": {x: _round(m["ttft_ms"]["p50"]) for x, m in runs.items()},
            "tpot_p50_ms": {x: _round(m["tpot_ms"]["p50"]) for x, m in runs.items()},
            "errors": sum(m["errors"] for m in runs.values()),
        }
    return {
        "complete": doc.get("complete"),
        "systems": per_system,
        "skipped": {k: v.splitlines()[0][:300] for k, v in doc["skipped"].items()},
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def figures(step: Step) -> object:
    try:
        if step.name == "tests":
            return summarize_tests(step.log.with_name("tests.xml"), step.log)
        if step.result is None or not step.result.exists():
            return None
        if step.name.endswith("engine overhead"):
            return summarize_overhead(step.result)
        return summarize_serve(step.result)
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
