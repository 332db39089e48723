"""A model's tokenizer kept in the cache dir between starts (server/tokenizer_cache.py)."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest
import transformers

from server import tokenizer_cache
from server.tokenizer_cache import load_tokenizer, tokenizer_key

TEXTS = ["Hello world! How are you", "  two spaces\nand a line", "<s> special </s>", "日本語"]


def kept(cache: Path) -> list[Path]:
    """The cache's tokenizer entries, once the thread that writes them is done."""
    for thread in threading.enumerate():
        if thread.name == "beamline-tokenizer":
            thread.join(30)
    return sorted((cache / "tokenizers").glob("*.pickle"))


def never_from_files(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer was built from its files")

    monkeypatch.setattr(tokenizer_cache.AutoTokenizer, "from_pretrained", refuse)


@pytest.fixture
def model_dir(llama_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(llama_dir, copy)
    return copy


def test_a_later_start_reads_the_kept_tokenizer_and_it_tokenizes_alike(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    built = load_tokenizer(model_dir, cache)
    assert [p.stem for p in kept(cache)] == [tokenizer_key(model_dir)]
    never_from_files(monkeypatch)
    read = load_tokenizer(model_dir, cache)
    assert type(read) is type(built) and read is not built
    for text in TEXTS:
        assert read(text).input_ids == built(text).input_ids
        assert read.decode(built(text).input_ids) == built.decode(built(text).input_ids)
    assert read.all_special_ids == built.all_special_ids and len(read) == len(built)
    assert read.chat_template == built.chat_template


def test_a_changed_tokenizer_file_is_a_new_entry(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load_tokenizer(model_dir, cache)
    before = tokenizer_key(model_dir)
    config = model_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace("}", ', "model_max_length": 77}', 1))
    assert tokenizer_key(model_dir) != before
    assert load_tokenizer(model_dir, cache).model_max_length == 77
    assert len(kept(cache)) == 2
    changed = tokenizer_key(model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")  # the weights are not part of the key
    assert tokenizer_key(model_dir) == changed


def test_an_unreadable_entry_is_built_again_and_replaced(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    (cache / "tokenizers").mkdir(parents=True)
    entry = cache / "tokenizers" / f"{tokenizer_key(model_dir)}.pickle"
    entry.write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="server.tokenizer_cache"):
        tokenizer = load_tokenizer(model_dir, cache)
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerBase)
    assert "not read" in caplog.text
    assert kept(cache) == [entry] and entry.stat().st_size > 1000


def test_without_a_cache_dir_nothing_is_kept(model_dir: Path) -> None:
    assert isinstance(load_tokenizer(model_dir), transformers.PreTrainedTokenizerBase)
