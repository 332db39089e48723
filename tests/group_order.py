"""Longest group first under pytest-xdist's `--dist loadgroup` (the README's test command).

Each test file is one group (tests/conftest.py marks them; the client suite is one group), and a
group runs whole on one worker. xdist hands out groups in the order it is given them; by default it
sorts them by how many tests they hold, which sent the slowest files (one test of minutes each)
last, so one worker ran alone for minutes at the end. Here the groups go out longest first, by the
seconds each took in a recorded run (`group_durations.json`); groups not recorded go after them, in
collection order. Refresh the record after adding or slowing a heavy file:

    python -m pytest -n 2 --dist loadgroup --store-group-durations
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("group_durations.json")
_recorded: dict[str, float] = defaultdict(float)  # this run's seconds by group, when storing


def group_of(nodeid: str) -> str:
    """The xdist group of a test: its file, or the client suite as a whole (one shared server)."""
    module = nodeid.split("::")[0].split("@")[0]
    return "tests/clients" if module.startswith("tests/clients/") else module


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-group-durations",
        action="store_true",
        help=f"write each test group's seconds (setup, call, teardown) to {DURATIONS.name}",
    )


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist installed: keep our order
        config.option.loadscopereorder = False


def recorded_seconds() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: recorded groups by seconds, longest first, then the rest."""
    seconds = recorded_seconds()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(group_of(item.nodeid), len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        group = group_of(item.nodeid)
        return (-seconds.get(group, 0.0), first_seen[group])

    items.sort(key=key)  # stable: a group's own tests keep their order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _recorded[group_of(report.nodeid)] += report.duration  # workers' reports reach the controller


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("--store-group-durations"):
        return  # a worker's reports reach the controller, which writes the record once
    merged = {**recorded_seconds(), **{g: round(s, 1) for g, s in _recorded.items()}}  # a subset
    ordered = dict(sorted(merged.items(), key=lambda x: -x[1]))  # run updates only its groups
    DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
