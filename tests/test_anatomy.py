"""The shape of the code base: module sizes, import direction between layers, no import circles.

These are the rules of the architecture docs (docs/architecture), checked on the source itself
(ast), so that a change that grows a hub class or lets the scheduler import model code fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "decoding")
MAX_FILE_LINES = 350
MAX_CLASS_LINES = 250


def source_files() -> dict[str, Path]:
    """Module name -> path of every module in server/ and decoding/."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """Project modules `name` imports, type-only (TYPE_CHECKING) and function-level ones too."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


GRAPH = {n: imports_of(n, p, set(source_files())) for n, p in source_files().items()}


def test_no_import_circle() -> None:
    """Depth-first search for a back edge; package __init__ re-exports count as edges too."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def reaches(start: str, prefix: str) -> list[str]:
    """Modules under `prefix` that `start` imports, directly or through other modules."""
    seen, todo = set(), [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(m for m in seen if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("server.engine.scheduler", "server.model"),  # scheduling never imports model code
        ("server.engine.block_pool", "server.model"),
        ("server.engine.prefix_cache", "server.model"),
        *((m, "server.engine") for m in GRAPH if m.startswith("server.model")),
        *((m, "server.api") for m in GRAPH if m.startswith(("server.model", "server.engine"))),
        # the engine process is wiring above the engine: nothing below it knows where it runs
        *(
            (m, "server.process")
            for m in GRAPH
            if m.startswith(("server.model", "server.engine", "server.api"))
        ),
        *((m, "server") for m in GRAPH if m.startswith("decoding")),  # pure algorithms
        # the step plan is the contract: it knows neither side
        ("server.step_plan", "server.engine"),
        ("server.step_plan", "server.model"),
        # tensor parallelism's collectives, splits and plan broadcast sit below the model side;
        # only its rank processes (workers.py) build a model runner
        *(
            (m, prefix)
            for m in ("server.parallel.group", "server.parallel.shard")
            for prefix in ("server.model", "server.engine", "server.parallel.plan_broadcast")
        ),
        ("server.parallel.plan_broadcast", "server.model"),
        ("server.parallel.plan_broadcast", "server.engine"),
        *((m, "server.parallel.workers") for m in GRAPH if m.startswith("server.model")),
        # the engine process is wiring above loading, the runner's set-up and the ranks
        *(
            (m, "server.process")
            for m in ("server.loading", "server.runner_setup", "server.parallel.workers")
        ),
    ],
)
def test_layers_import_only_downwards(module: str, forbidden: str) -> None:
    assert reaches(module, forbidden) == []


def test_the_api_reaches_the_engine_only_through_the_client_protocol_and_its_output_types() -> None:
    allowed = {"server.engine", "server.engine.client", "server.engine.request"}
    for module in (m for m in GRAPH if m.startswith("server.api")):
        engine_imports = {d for d in GRAPH[module] if d.startswith("server.engine")}
        assert engine_imports <= allowed, module
        text = source_files()[module].read_text()
        assert ".engine.engine" not in text, f"{module} reaches inside the engine"


@pytest.mark.parametrize("name", sorted(source_files()))
def test_files_and_classes_stay_small(name: str) -> None:
    path = source_files()[name]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"class {node.name} has {size} lines"
