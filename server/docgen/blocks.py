"""Generated blocks: a page holds a block between its two marker comments, and the block's text
is rendered from the code. Everything outside the markers is written by hand."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.api import field_docs

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"


@dataclass(frozen=True)
class Block:
    name: str
    render: Callable[[], str]
    start: str
    end: str


def _block(name: str, render: Callable[[], str]) -> Block:
    start = f"<!-- generated:{name} (python -m server.docgen) -->"
    return Block(name, render, start, f"<!-- /generated:{name} -->")


def blocks() -> list[Block]:
    """Every block, imported late: each reads a different corner of the server."""
    from server.docgen import metrics_table, published, request_fields, routes, settings

    return [
        _block("request-fields", request_fields.render_all_fields),
        _block("request-body-parts", request_fields.render_body_parts),
        _block("audio-fields", request_fields.render_audio_fields),
        Block("extension-fields", field_docs.render_table, field_docs.START, field_docs.END),
        _block("config-keys", settings.render_config_keys),
        _block("cli", settings.render_cli),
        _block("metrics", metrics_table.render_metrics),
        _block("routes", routes.render_routes),
        _block("published", published.render_published),
    ]


def refresh(text: str, rendered: dict[str, str]) -> str:
    """`text` with every block it holds rewritten from `rendered` (block name -> text)."""
    for block in blocks():
        head, start, rest = text.partition(block.start)
        if not start:
            continue
        _, end, tail = rest.partition(block.end)
        if not end:
            raise ValueError(f"block {block.name}: {block.start!r} without {block.end!r}")
        text = f"{head}{start}\n{rendered[block.name]}\n{end}{tail}"
    return text


def pages() -> list[Path]:
    """The docs pages that hold at least one block."""
    markers = [b.start for b in blocks()]
    return [p for p in sorted(DOCS.rglob("*.md")) if any(m in p.read_text() for m in markers)]


def stale_pages(write: bool) -> list[Path]:
    """Pages whose blocks differ from the code (rewritten when `write`)."""
    rendered = {b.name: b.render() for b in blocks()}
    stale = []
    for page in pages():
        text = page.read_text()
        updated = refresh(text, rendered)
        if updated != text:
            stale.append(page)
            if write:
                page.write_text(updated)
    return stale
