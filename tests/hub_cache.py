"""A Hugging Face hub cache on disk, laid out as huggingface_hub writes a download, so that hub ids
resolve with no network: `models--org--name/blobs/<hash>` holds each file's bytes,
`snapshots/<commit>/<path>` links to its blob, `refs/<branch>` holds the branch's commit."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

GGUF_REPO = "gguf-org/gemma-3-270m-GGUF"
# The default model's GGUF under two quant names: a GGUF repository's files differ in their quant;
# here both hold the same bytes (the selector only picks a name).
GGUF_QUANTS = ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-Q8_0.gguf")
BIG_FILE = 64 * 2**20


def commit_of(text: str) -> str:
    """A 40-hex commit id, as the hub's (any stable one will do)."""
    return hashlib.sha1(text.encode()).hexdigest()


def write_snapshot(
    cache: Path, repo_id: str, files: dict[str, Path], commit: str, refs: tuple[str, ...] = ()
) -> Path:
    """Put `files` (path in the repo -> a file here) into `cache` as commit `commit` of
    `repo_id`, with `refs` (branches, tags) naming it; returns the snapshot directory. Small
    files are copied into their blobs; a big one's blob links to it (250 MB not copied)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        size = source.stat().st_size
        big = size > BIG_FILE
        content = f"{source.resolve()}:{size}".encode() if big else source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if big:
                blob.symlink_to(source.resolve())
            else:
                shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def model_files(model_dir: Path) -> dict[str, Path]:
    """Every file of a saved model directory, by its name in the repository."""
    return {str(p.relative_to(model_dir)): p for p in model_dir.rglob("*") if p.is_file()}


def write_gguf_repo(cache: Path, gguf: Path) -> Path:
    """GGUF_REPO holding `gguf` under both GGUF_QUANTS names (main = its one commit)."""
    files = {name: gguf for name in GGUF_QUANTS}
    files["README.md"] = Path(__file__)  # a repository holds more than its weights
    return write_snapshot(cache, GGUF_REPO, files, commit_of("gguf"), refs=("main",))
