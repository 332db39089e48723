"""A model's tokenizer, kept in the cache dir between starts.

transformers builds a large tokenizer from its files in seconds: Gemma 3's 262k vocabulary took
about 3 s on a 2-core CPU, most of it parsing `tokenizer.json` in Python, several times over. The
tokenizer it built, pickled into `<cache_dir>/tokenizers/`, loads in about a third of that. An
entry's key is the model directory's files other than weights (names, sizes, modification
times), where that directory is, and the versions of Python, transformers and tokenizers; an entry
that is missing or cannot be read is built again from the files, with a warning in the second
case. The cache dir is the server's own, like the compiled steps it also holds (which are
pickles too).

Beside it lies the grammar engine's view of the vocabulary (`TokenBytes`: each token's bytes),
which llguidance otherwise reads from `tokenizer.json` in 3-4 s of held GIL for a 262k
vocabulary: a plain file of lengths and bytes, read in tens of milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import pickle
import platform
import sys
import threading
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from decoding.grammar import TokenBytes
from server.model.compile_cache import WEIGHT_SUFFIXES, write_aside

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
    def write(file: BinaryIO) -> None:
        pickle.dump(tokenizer, file, protocol=pickle.HIGHEST_PROTOCOL)

    _write_aside(entry, write, "tokenizer")  # a tokenizer that does not pickle: a warning too


def _write_aside(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """write_aside, with a warning naming `what` when it cannot be kept (a read-only cache dir,
    a full disk)."""
    try:
        write_aside(path, write)
    except Exception as error:
        log.warning("%s not kept in %s: %s", what, path.parent, error)


TOKEN_BYTES_MAGIC = b"beamline token bytes 1\n"


def token_bytes_path(model_dir: Path, cache: Path | None) -> Path | None:
    """Where `model_dir`'s vocabulary as llguidance sees it is kept (None: nowhere)."""
    if cache is None:
        return None
    version = importlib.metadata.version("llguidance")
    return cache / "tokenizers" / f"{tokenizer_key(model_dir)}.llguidance-{version}.bin"


def read_token_bytes(path: Path) -> TokenBytes | None:
    """The kept vocabulary, or None when there is none (or it cannot be read: a warning)."""
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
        if not data.startswith(TOKEN_BYTES_MAGIC):
            raise ValueError("not a token bytes file")
        header_end = data.index(b"\n", len(TOKEN_BYTES_MAGIC)) + 1
        header = json.loads(data[len(TOKEN_BYTES_MAGIC) : header_end])
        if header["byteorder"] != sys.byteorder:
            raise ValueError(f"written on a {header['byteorder']}-endian machine")
        lengths = array("I")
        lengths_end = header_end + header["count"] * lengths.itemsize
        lengths.frombytes(data[header_end:lengths_end])
        tokens, start = [], lengths_end
        for length in lengths:
            tokens.append(data[start : start + length])
            start += length
        if start != len(data):
            raise ValueError(f"{len(data) - start} bytes more or less than the lengths say")
        return TokenBytes(tokens, [int(i) for i in header["special"]])
    except Exception as error:  # truncated, written by other software: build it again
        log.warning("kept grammar vocabulary %s not read (%s): reading the tokenizer", path, error)
        return None


def keep_token_bytes(token_bytes: TokenBytes, path: Path) -> None:
    """Write the vocabulary aside, then rename it into place (a warning if it cannot be)."""
    header = {"count": len(token_bytes.tokens), "special": token_bytes.special_ids}
    header["byteorder"] = sys.byteorder

    def write(file: BinaryIO) -> None:
        file.write(TOKEN_BYTES_MAGIC + json.dumps(header).encode() + b"\n")
        file.write(array("I", map(len, token_bytes.tokens)).tobytes())
        file.write(b"".join(token_bytes.tokens))

    _write_aside(path, write, "grammar vocabulary")
