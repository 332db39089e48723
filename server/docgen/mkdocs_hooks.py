"""mkdocs hook (mkdocs.yml: `hooks`): images kept beside the code they describe, published into
the site without a copy in docs/: benchmark plots from benchmarks/published/ under
`assets/published/`, the playground's screenshot under `assets/playground.png`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO_ROOT = Path(__file__).resolve().parents[2]


def images() -> dict[str, Path]:
    """Site path -> source file."""
    found = {
        f"assets/published/{png.name}": png
        for png in sorted((REPO_ROOT / "benchmarks" / "published").glob("*.png"))
    }
    found["assets/playground.png"] = REPO_ROOT / "server" / "playground" / "screenshot.png"
    return found


def on_files(files: Files, config: Any) -> Files:
    for uri, source in images().items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files
