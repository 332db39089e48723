"""What the one-time conversions into the cache directory share (a GGUF file's in loader.py, a
CTranslate2 Whisper's in ct2_whisper.py): the key that names a converted copy after its source
file, and the rename that puts a finished copy into place when servers start at once."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def file_key(path: Path) -> str:
    """A key of `path`'s identity (where it is, its size, when it changed)."""
    st = path.stat()
    identity = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def rename_into_place(tmp: Path, target: Path) -> None:
    """Put the finished copy `tmp` at `target`: each process writes a folder of its own and
    renames it, so servers (or test workers) starting at once on one host never read a
    half-written copy; the first to finish wins and the others' copies are removed."""
    if (target / "config.json").is_file():  # converted meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(target, ignore_errors=True)  # what a crash of an older release left
    try:
        tmp.rename(target)
    except OSError:  # another process renamed its copy into place first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
