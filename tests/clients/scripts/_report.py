"""What every client script shares (stdlib only: it runs in the client's own venv).

A script runs named cases against `sys.argv[1]` (the server's .../v1) with model `sys.argv[2]`;
each case returns what the client handed its user, as JSON-able data, or raises. The last
stdout line is the report, which tests/clients/ asserts on.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

BASE_URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
MODEL = sys.argv[2] if len(sys.argv) > 2 else "gemma-3-270m"
TIMEOUT_S = 300.0


class Report:
    """Runs cases one by one (a failing one does not hide the others) and prints the report."""

    def __init__(self, *distributions: str) -> None:
        self.versions = {name: version(name) for name in distributions}
        self.cases: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.monotonic()
        try:
            self.cases[name] = {"ok": True, **fn()}
        except Exception:  # the client's own exception is the finding: keep it whole
            self.cases[name] = {"ok": False, "error": traceback.format_exc()}
        took = time.monotonic() - start
        self.cases[name]["seconds"] = round(took, 2)
        print(
            f"{name}: {'ok' if self.cases[name]['ok'] else 'FAILED'} ({took:.1f} s)",
            file=sys.stderr,
        )

    def emit(self) -> None:
        print(json.dumps({"versions": self.versions, "cases": self.cases}, default=str))
