"""A model's tokenizer, and the grammar engine's view of its vocabulary, kept in the cache dir
between starts (server/tokenizer_cache.py)."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from decoding.grammar import GrammarCompiler, GrammarSpec, TokenBytes
from server import grammars, tokenizer_cache
from server.grammars import GrammarService, build_compiler
from server.tokenizer_cache import load_tokenizer, read_token_bytes, token_bytes_path, tokenizer_key

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


class RecordedCompilers:
    """GrammarCompiler as build_compiler calls it, each call's kept bytes recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.given: list[TokenBytes | None] = []
        real = grammars.GrammarCompiler

        def record(*args: Any, token_bytes: TokenBytes | None = None) -> GrammarCompiler:
            self.given.append(token_bytes)
            return real(*args, token_bytes=token_bytes)

        monkeypatch.setattr(grammars, "GrammarCompiler", record)


def test_a_later_start_reads_the_grammar_vocabulary_it_kept(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start keeps llguidance's view of the vocabulary; a later one builds its grammar
    compiler from it, and compiles to the same masks."""
    path = token_bytes_path(model_dir, tmp_path / "cache")
    assert path is not None and path.name.startswith(tokenizer_key(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    compilers = RecordedCompilers(monkeypatch)
    first = GrammarService(tokenizer, len(tokenizer), frozenset({2}), token_bytes_path=path)
    assert first.prepare() and path.is_file()
    second = GrammarService(tokenizer, len(tokenizer), frozenset({2}), token_bytes_path=path)
    assert second.prepare()
    assert compilers.given[0] is None
    assert compilers.given[1] == read_token_bytes(path) == first._get_compiler().token_bytes()
    spec = GrammarSpec("regex", "[a-z]+ [0-9]{2}")
    masks = torch.zeros((2, (len(tokenizer) + 31) // 32), dtype=torch.int32)
    for index, service in enumerate((first, second)):
        service._get_compiler().compile(spec).new_constraint().fill_allowed(masks, index)
    assert torch.equal(masks[0], masks[1]) and masks[0].any()


@pytest.mark.parametrize("damage", ["truncated", "other software"])
def test_an_unreadable_grammar_vocabulary_is_read_from_the_tokenizer_and_kept_anew(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    path = token_bytes_path(model_dir, tmp_path / "cache")
    assert path is not None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    build_compiler(tokenizer, len(tokenizer), frozenset({2}), path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-3] if damage == "truncated" else b"PK\x03\x04" + whole[4:])
    compilers = RecordedCompilers(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="server.tokenizer_cache"):
        build_compiler(tokenizer, len(tokenizer), frozenset({2}), path)
    assert compilers.given == [None] and "not read" in caplog.text
    assert path.read_bytes() == whole


def test_a_grammar_vocabulary_that_cannot_be_kept_is_a_warning(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache dir's folder would be")
    path = token_bytes_path(model_dir, blocked)
    assert path is not None
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with caplog.at_level(logging.WARNING, logger="server.tokenizer_cache"):
        compiler = build_compiler(tokenizer, len(tokenizer), frozenset({2}), path)
    assert compiler.compile(GrammarSpec("regex", "a+")) is not None
    assert "grammar vocabulary not kept" in caplog.text and not path.exists()
    assert token_bytes_path(model_dir, None) is None
