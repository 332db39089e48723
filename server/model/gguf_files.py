"""Reading GGUF files for their conversion (loader.convert_gguf): every reader transformers builds
shares one parse of the file, and the tokenizer is converted in a process of its own while the
converting process dequantizes the weights.

    python -m server.model.gguf_files FILE.gguf FOLDER   # the tokenizer into FOLDER

Both halves are bound to Python; side by side on 2 cores, the tokenizer's (its own imports and
parse included) ends about when the weights' does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from server.model.chat_templates import add_missing_chat_template


def save_gguf_tokenizer(gguf: Path, folder: Path) -> int | None:
    """Convert the GGUF file's tokenizer into `folder`; the id of `<end_of_turn>` when the file
    has no chat template and gets Gemma's (the model's generation config is then to stop at it
    too: chat_templates.stop_at), else None."""
    from transformers import AutoTokenizer

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    end_of_turn = add_missing_chat_template(tokenizer)
    tokenizer.save_pretrained(folder)
    return end_of_turn


class TokenizerProcess:
    """`save_gguf_tokenizer` run by a Python process of its own: started now, awaited by
    `result()`. (A plain subprocess, not multiprocessing: nothing of the caller's `__main__` is
    imported again there.)"""

    def __init__(self, gguf: Path, folder: Path) -> None:
        command = [sys.executable, "-m", __name__, str(gguf), str(folder)]
        # files, not pipes: a pipe nobody reads until the weights are done could fill and stall it
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.process = subprocess.Popen(command, stdout=self.out, stderr=self.err)

    def result(self) -> int | None:
        """What `save_gguf_tokenizer` returned; RuntimeError with the process's last words if it
        failed."""
        code = self.process.wait()
        out, err = (self._read(file) for file in (self.out, self.err))
        if code != 0:
            last = " ".join(err.strip().splitlines()[-1:]) or f"exit {code}"
            raise RuntimeError(f"converting the GGUF file's tokenizer failed: {last}")
        end_of_turn = json.loads(out.strip().splitlines()[-1])["end_of_turn"]
        return None if end_of_turn is None else int(end_of_turn)

    def stop(self) -> None:
        """End it early (the weights' half failed)."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        for file in (self.out, self.err):
            file.close()

    @staticmethod
    def _read(file: IO[bytes]) -> str:
        with file:
            file.seek(0)
            return file.read().decode(errors="replace")


def plain_view_reader(base: type) -> type:
    """gguf's reader `base`, parsing through a plain array view of its memory map: each of the
    ~800k slices it takes of a 262k-token vocabulary was a `numpy.memmap`, whose Python-level
    `__array_finalize__` made the parse 8.2 s; over the view (the same memory, no copy) 2.4 s,
    with the same fields and tensors. `base` itself where it reads differently (another gguf)."""
    if not callable(getattr(base, "_get", None)):
        return base

    class PlainViewReader(base):  # type: ignore[valid-type, misc]
        def _get(self, *args: Any, **kwargs: Any) -> Any:
            data: Any = self.__dict__["data"]  # np.memmap(path) is __init__'s first line
            if type(data) is np.memmap:
                self.data = data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return PlainViewReader


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within, each GGUF file is parsed once. transformers parses a GGUF file anew for its
    config, its tokenizer and its weights, and gguf's reader walks a 262k-token vocabulary one
    element at a time: the default model's conversion built the reader 3 times, 25.6 of its
    40.9 s on a 2-core AMD EPYC. The reader holds memory-mapped views of the file, not copies, so
    one can serve every load. Each tensor-name map is built once too: transformers asks gguf for
    one per module of the model (313 for Gemma 3 270M, 2.3 of the weights' 9.2 s on a 2-core
    Xeon), and gguf builds each anew from the same two arguments. (transformers imports
    `gguf.GGUFReader` and `gguf.get_tensor_name_map` at each call: it finds these while the block
    runs.)"""
    try:
        import gguf
    except ImportError:  # transformers says what to install when it needs it
        yield
        return
    original, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain_view = plain_view_reader(original)
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = plain_view(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc, assignment]
    gguf.get_tensor_name_map = functools.cache(original_name_map)  # read, never changed
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
        gguf.get_tensor_name_map = original_name_map


def main(argv: list[str] | None = None) -> int:
    gguf, folder = (Path(arg) for arg in (argv if argv is not None else sys.argv[1:]))
    print(json.dumps({"end_of_turn": save_gguf_tokenizer(gguf, folder)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
