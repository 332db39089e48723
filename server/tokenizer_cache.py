"""A model's tokenizer, kept in the cache dir between starts.

transformers builds a large tokenizer from its files in seconds: Gemma 3's 262k vocabulary took
about 3 s on a 2-core CPU, most of it parsing `tokenizer.json` in Python, several times over. The
tokenizer it built, pickled into `<cache_dir>/tokenizers/`, loads in about a third of that. An
entry's key is the model directory's files other than weights (names, sizes, modification
times), where that directory is, and the versions of Python, transformers and tokenizers; an entry
that is missing or cannot be read is built again from the files, with a warning in the second
case. The cache dir is the server's own, like the compiled steps it also holds (which are
pickles too).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import pickle
import platform
import threading
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server.model.compile_cache import WEIGHT_SUFFIXES, partial_path

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path, cache: Path | None = None) -> PreTrainedTokenizerBase:
    """`model_dir`'s tokenizer: from the cache dir's entry if it has one, else from the files
    (then kept there, in a thread, for the next start)."""
    entry = cache / "tokenizers" / f"{tokenizer_key(model_dir)}.pickle" if cache else None
    if entry is not None and entry.is_file():
        try:
            with entry.open("rb") as file:
                loaded = pickle.load(file)
            if isinstance(loaded, PreTrainedTokenizerBase):
                return loaded
            raise TypeError(f"a {type(loaded).__name__}, not a tokenizer")
        except Exception as error:  # truncated, written by other software: build it again
            log.warning("cached tokenizer %s not read (%s): reading the files", entry, error)
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=False
    )
    if entry is not None:
        keep = threading.Thread(target=_keep, args=(tokenizer, entry), name="beamline-tokenizer")
        keep.daemon = True
        keep.start()
    return tokenizer


def tokenizer_key(model_dir: Path) -> str:
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for name in ("transformers", "tokenizers"):
        digest.update(f"{name}={importlib.metadata.version(name)}\n".encode())
    digest.update(f"python={platform.python_version()}\n".encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _keep(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    """Write the entry aside, then rename it into place: a start reading it never sees half."""
    partial = partial_path(entry)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as file:
            pickle.dump(tokenizer, file, protocol=pickle.HIGHEST_PROTOCOL)
        partial.replace(entry)
    except Exception as error:  # a read-only cache dir, a tokenizer that does not pickle
        log.warning("tokenizer not kept in %s: %s", entry.parent, error)
        partial.unlink(missing_ok=True)
