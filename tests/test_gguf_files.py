"""A GGUF file's tokenizer converted by a process of its own while the weights convert
(server/model/gguf_files.py, loader.convert_gguf)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.model import loader
from server.model.gguf_files import TokenizerProcess, save_gguf_tokenizer
from server.model.loader import default_gguf_path


@pytest.mark.default_model
def test_the_tokenizer_process_writes_what_converting_here_writes(tmp_path: Path) -> None:
    gguf = default_gguf_path()
    beside, here = tmp_path / "beside", tmp_path / "here"
    converting = TokenizerProcess(gguf, beside)
    assert save_gguf_tokenizer(gguf, here) == converting.result()
    files = sorted(p.name for p in here.iterdir())
    assert "tokenizer.json" in files and files == sorted(p.name for p in beside.iterdir())
    for name in files:
        assert contents(beside / name) == contents(here / name), name


def contents(path: Path) -> object:
    """The file's bytes; for tokenizer_config.json its settings, but for `local_files_only`,
    which records whether the loading process was offline (a test before this one in the same
    worker may have left this process offline, not the one beside it)."""
    if path.name != "tokenizer_config.json":
        return path.read_bytes()
    config = json.loads(path.read_text())
    config.pop("local_files_only", None)
    return config


def test_a_tokenizer_process_that_fails_says_why(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a GGUF file at all")
    with pytest.raises(RuntimeError, match="converting the GGUF file's tokenizer failed: .+"):
        TokenizerProcess(gguf, tmp_path / "out").result()


def test_weights_that_fail_to_convert_stop_the_tokenizer_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    stopped: list[bool] = []

    class Converting:
        def __init__(self, gguf: Path, folder: Path) -> None:
            pass

        def stop(self) -> None:
            stopped.append(True)

    def fail(*args: object, **kwargs: object) -> None:
        raise ValueError("GGUF model with architecture x is not supported yet.")

    monkeypatch.setattr(loader, "TokenizerProcess", Converting)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError, match="not supported"):
        loader.convert_gguf(gguf, loader.conversion_dir(gguf, tmp_path))
    assert stopped == [True]
