"""Where a compiled decode step lives on disk: the key of its cache entry (the model, the number
formats, the software and the CPU it was compiled for) and the lock that lets one process at a time
write an entry."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

log = logging.getLogger(__name__)
# files that hold a model's weights (what the tokenizer's key leaves out, the weights' key reads)
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack"})


def cache_key(identity: dict[str, str]) -> str:
    """A digest of everything the compiled graphs depend on: the caller's `identity` (model,
    number formats, layouts), the software that traced and built them, beamline's model code (its
    LoRA and tensor-parallel layers too: the guards do not check source) and the CPU's
    instruction set (inductor's kernels are built for it)."""
    return hashlib.sha256(key_text(identity).encode()).hexdigest()[:16]


def key_text(identity: dict[str, str]) -> str:
    """What `cache_key` digests, one `name=value` line each (kept beside the graphs, so that an
    entry says what it was compiled for)."""
    parts = dict(identity)
    parts["python"] = platform.python_version()
    parts["torch"] = torch.__version__
    parts["transformers"] = importlib.metadata.version("transformers")
    parts["cpu"] = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    # the graphs' guards check torch's thread count: a start with other `--num-threads` keeps an
    # entry of its own rather than failing the guards and overwriting this one
    parts["torch_threads"] = str(torch.get_num_threads())
    code = hashlib.sha256()
    server = Path(__file__).parent.parent  # the model side and the TP layers the graphs trace
    for path in sorted([*server.joinpath("model").rglob("*.py"), *server.glob("parallel/*.py")]):
        code.update(path.read_bytes())
    parts["beamline_model_code"] = code.hexdigest()
    return "\n".join(f"{k}={v}" for k, v in sorted(parts.items())) + "\n"


def model_identity(model_dir: Path) -> str:
    """The model as the compiled graphs see it: its config and its weights' names, number formats
    and shapes (a safetensors file's header; a name and size for other formats), not where it
    lies nor the weights' values, which the graphs take as inputs. A copy of the model in another
    folder, or a fine-tune of the same architecture, loads the same entry."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix == ".safetensors":
            digest.update(path.name.encode() + _safetensors_layout(path))
        elif path.suffix in (".bin", ".gguf"):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()


def _safetensors_layout(path: Path) -> bytes:
    """A safetensors file's header (each tensor's name, dtype, shape and offsets) without its free
    `__metadata__`: the first 8 bytes are the header's length."""
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
    header.pop("__metadata__", None)
    return json.dumps(header, sort_keys=True).encode()


def partial_path(path: Path) -> Path:
    """Where this process writes `path` before renaming it into place."""
    return path.with_name(f"{path.name}.{os.getpid()}.partial")


def write_aside(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write` `path`'s bytes aside, then rename them into place: a process reading it never sees
    half. On an error the partial file is removed and the error raised."""
    partial = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as file:
            write(file)
        partial.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # never written, or not writable either
            partial.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def entry_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on a cache entry (a file beside it); the OS releases it if the
    holder dies. A cache that cannot be written takes no lock: nothing is saved there anyway."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        file = directory.with_name(directory.name + ".lock").open("a")
    except OSError:
        yield
        return
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is compiling %s: waiting to load its graphs", directory)
            fcntl.flock(file, fcntl.LOCK_EX)
        yield
