"""The test run's own scheduling (tests/group_order.py): recorded groups go out longest first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import group_order

REPO = Path(__file__).resolve().parents[1]


def test_recorded_groups_go_first_longest_first_and_a_groups_tests_keep_their_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        group_order,
        "recorded_seconds",
        lambda: {"tests/test_b.py": 5.0, "tests/test_c.py": 90.0, "tests/clients": 30.0},
    )
    ids = [
        "tests/test_a.py::one",
        "tests/test_b.py::one",
        "tests/clients/test_x.py::one@tests/clients",
        "tests/test_c.py::one",
        "tests/test_d.py::one",
        "tests/test_b.py::two",
        "tests/clients/test_y.py::one@tests/clients",
        "tests/test_c.py::two",
    ]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    group_order.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/test_c.py::one",
        "tests/test_c.py::two",
        "tests/clients/test_x.py::one@tests/clients",
        "tests/clients/test_y.py::one@tests/clients",
        "tests/test_b.py::one",
        "tests/test_b.py::two",
        "tests/test_a.py::one",  # not recorded: after the recorded ones, in collection order
        "tests/test_d.py::one",
    ]


def test_the_record_names_only_groups_that_exist() -> None:
    recorded = group_order.recorded_seconds()
    assert recorded and all(seconds >= 0 for seconds in recorded.values())
    assert [g for g in recorded if not (REPO / g).exists()] == []
