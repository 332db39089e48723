from pathlib import Path

from transformers import AutoTokenizer

from server.engine.detokenizer import IncrementalDetokenizer


def test_multibyte_characters_are_never_split_across_deltas(llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = " café, 東京 😀 naïve ✓ façade"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.split())  # byte-level pieces: some characters span several tokens
    detok = IncrementalDetokenizer(tok, tok("Prompt:").input_ids)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert any(d == "" for d in deltas)  # it did hold back incomplete bytes


def test_flush_emits_an_incomplete_tail(llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = tok("😀", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, [])
    for t in ids[:-1]:
        assert detok.push(t) == ""
    assert detok.flush() != ""  # the broken character is surfaced at the end, not lost
