import random
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "window"])
def test_streamed_text_equals_whole_decode_on_random_ids(llama_dir: Path, stream: bool) -> None:
    """Both paths, over random ids (special tokens and broken byte sequences included): the
    deltas plus the flush are exactly what decoding the whole output at once gives."""
    tok = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(0)
    words = "The quick brown fox café 東京 😀 naïve ✓ jumps over".split()
    broken = tok("😀", add_special_tokens=False).input_ids[:1]  # the first byte of four
    for trial in range(300):
        prompt = tok(" ".join(rng.choices(words, k=rng.randrange(0, 5)))).input_ids
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, stream=stream)
        deltas = [detok.push(t) for t in ids] + [detok.flush()]
        whole = tok.decode(prompt[-6:] + ids, skip_special_tokens=True)
        context = tok.decode(prompt[-6:], skip_special_tokens=True)
        assert "".join(deltas) == whole[len(context) :], trial
        assert detok.text == "".join(deltas)
        # a token-id prompt that ends mid-character: none of its bytes leak into the output
        detok = IncrementalDetokenizer(tok, prompt + broken, stream=stream)
        deltas = [detok.push(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), trial
