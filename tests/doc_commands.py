"""The command blocks of README.md and docs/, and what their markers ask for.

Every fenced `bash`, `sh`, `shell`, `console` or `python` block carries a marker comment on the
line before it (docs/contributing/docs.md explains them):

    <!-- doctest: run -->             run it against the test's live server
    <!-- doctest: serve -->           parse every `beamline serve ...` line, start nothing
    <!-- doctest: ci -->              the block appears verbatim in .ci/run
    <!-- doctest: skip: REASON -->    not run here, and why

`python -m tests.doc_commands serve ARGS...` is what a `serve` block's `beamline` runs: the real
parser takes the arguments and the configuration they make is validated, as `beamline serve`
does before it loads anything.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "python"})
KINDS = frozenset({"run", "serve", "ci", "skip"})
MARKER = re.compile(r"^<!-- doctest: (?P<kind>[a-z]+)(?::\s*(?P<reason>.*?))?\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    kind: str | None  # the marker's kind, None when the block has no marker
    reason: str  # a skip's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Marker:
    path: Path
    line: int
    kind: str
    reason: str
    fenced: bool  # the next line opens a fenced block


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path) -> tuple[list[Block], list[Marker]]:
    """The fenced blocks of one Markdown file and the markers in it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    markers: list[Marker] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line.strip())
        if marker:
            fenced = i + 1 < len(lines) and FENCE.match(lines[i + 1]) is not None
            markers.append(
                Marker(path, i + 1, marker["kind"], (marker["reason"] or "").strip(), fenced)
            )
        fence = FENCE.match(line)
        if fence is None:
            i += 1
            continue
        indent = len(fence["indent"])
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(x[indent:] for x in lines[i + 1 : end]) + "\n"
        before = MARKER.match(lines[i - 1].strip()) if i > 0 else None
        blocks.append(
            Block(
                path,
                i + 1,
                fence["lang"].lower(),
                code,
                before["kind"] if before else None,
                (before["reason"] or "").strip() if before else "",
            )
        )
        i = end + 1
    return blocks, markers


def command_blocks() -> list[Block]:
    return [b for p in documents() for b in parse(p)[0] if b.language in COMMAND_LANGUAGES]


def all_markers() -> list[Marker]:
    return [m for p in documents() for m in parse(p)[1]]


def check_serve(argv: list[str]) -> int:
    """What `beamline serve ARGS` would accept before loading anything: the real parser, then
    the configuration (file, flags) validated. Exit 0, or 2 with the problem."""
    from server.config import ConfigError, ServerConfig, load_config
    from server.docgen.settings import cli_parser

    if not argv or argv[0] != "serve":
        print(f"not a beamline serve command: beamline {' '.join(argv)}", file=sys.stderr)
        return 2
    args = cli_parser().parse_args(argv)  # exits 2 on an unknown flag or a bad choice
    overrides = {k: v for k, v in vars(args).items() if k in ServerConfig.model_fields}
    try:
        load_config(args.config, overrides, environ={})
    except ConfigError as exc:
        print(f"beamline: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m tests.doc_commands serve ARGS...")
    sys.exit(check_serve(sys.argv[1:]))
