"""Word timestamps: the engine's cross-attention scores of a window's text equal transformers'
cross-attentions of the same tokens (after a decode that leaves the window's encoder blocks in the
prefix cache, and in chunks of a few tokens), the alignment's dynamic time warping and median
filter equal transformers' own, and the PyPI whisper tiny.en's words and times equal
faster-whisper's on speech synthesized by espeak-ng, through the HTTP route and the openai SDK."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from faster_whisper import WhisperModel
from transformers import AutoTokenizer, WhisperForConditionalGeneration
from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

from benchmarks.speech_clips import SENTENCES
from decoding import DecodingParams
from server.audio.alignment import (
    Timed,
    _merge_punctuation,
    dynamic_time_warping,
    median_filter,
    split_words,
)
from server.audio.speech_model import window_salt
from server.engine.engine import Engine
from server.engine.request import EngineRequest
from server.model.seq2seq.runner import Seq2SeqRunner
from tests import test_whisper_tiny_en
from tests.audio_files import espeak_wav
from tests.conftest import TEST_DEVICE
from tests.engine_driver import Collected, run_to_completion
from tests.tiny_whisper import build_tiny_whisper, tiny_en_dir
from tests.whisper_jobs import speech_model, submit_window, window_params

tiny_en_url = test_whisper_tiny_en.tiny_en_url  # the live tiny.en server (its fixture)


def engine_of(model_dir: Path, budget: int) -> Engine:
    runner = Seq2SeqRunner(
        model_dir, device=TEST_DEVICE, dtype=torch.float32, block_size=16, num_blocks=512
    )
    runner.warm_up()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Engine(runner, tokenizer, max_num_seqs=8, max_num_batched_tokens=budget)


@pytest.mark.parametrize(("budget", "positions"), [(4096, 1500), (5, 700)])
def test_cross_attention_scores_equal_transformers(
    tmp_path: Path, budget: int, positions: int
) -> None:
    model_dir = build_tiny_whisper(tmp_path / "tiny")
    engine = engine_of(model_dir, budget)
    runner = engine.runner
    assert isinstance(runner, Seq2SeqRunner)
    # the tiny model has no alignment heads: openai-whisper's, every head of the second half
    assert runner.parts.alignment_heads == [(1, h) for h in range(4)]
    features = torch.randn(80, 3000, generator=torch.Generator().manual_seed(3))
    decoded = submit_window(engine, model_dir, "decode", features, window_params(model_dir))
    run_to_completion(engine)
    speech = speech_model(model_dir)
    text = [t for t in decoded.token_ids if t < speech.end_of_text][:9]
    decoder = [*speech.decoder_prompt(None), *text, speech.end_of_text]
    params = DecodingParams(
        max_tokens=0, cross_attention=positions, cache_salt=window_salt(features)
    )
    got = Collected()
    engine.submit(
        EngineRequest(
            "align",
            speech.engine_prompt(decoder),
            params,
            got.outputs.append,
            source_len=speech.source_positions,
            source_features=features,
        )
    )
    run_to_completion(engine)
    (out,) = got.outputs
    assert out.error is None and out.cached_tokens == 1488  # the window's encoder blocks
    scores = out.cross_attention
    assert scores is not None and scores.shape == (4, len(decoder), positions)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        theirs = model(
            input_features=features[None],
            decoder_input_ids=torch.tensor([decoder]),
            output_attentions=True,
        ).cross_attentions
    expected = torch.stack(
        [theirs[layer][0, head] for layer, head in [(1, 0), (1, 1), (1, 2), (1, 3)]]
    )
    # over the positions asked for: their share of the attention, as a softmax over them alone
    expected = expected[..., :positions] / expected[..., :positions].sum(-1, keepdim=True)
    torch.testing.assert_close(scores.softmax(-1), expected, atol=1e-5, rtol=1e-4)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_cross_attention_asks_for_a_prompt_only_request() -> None:
    with pytest.raises(ValueError, match="cross_attention needs max_tokens 0"):
        DecodingParams(max_tokens=4, cross_attention=1500)


def test_time_warping_and_the_median_filter_equal_transformers() -> None:
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (3, 7), (40, 700), (7, 3)]:
        cost = rng.standard_normal(shape)
        ours, theirs = dynamic_time_warping(cost), _dynamic_time_warping(cost)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    ties = rng.integers(0, 3, (30, 60)).astype(float)  # the order in which ties are broken
    ours, theirs = dynamic_time_warping(ties), _dynamic_time_warping(ties)
    assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    weights = torch.randn(4, 9, 50)
    assert torch.equal(median_filter(weights, 7), _median_filter(weights, 7))


def test_words_split_at_spaces_or_at_characters_and_punctuation_joins_its_word() -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_en_dir())
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer(' Hello, world! "Quoted" (x)', add_special_tokens=False).input_ids
    words, tokens = split_words(tokenizer, [*ids, end], end, "en")
    assert words == [" Hello", ",", " world", "!", ' "Quoted', '"', " (x", ")", "<|endoftext|>"]
    assert sum(tokens, []) == [*ids, end]
    chinese = tokenizer(" 你好世界", add_special_tokens=False).input_ids  # two tokens a character
    assert split_words(tokenizer, [*chinese, end], end, "zh")[0] == [
        *" 你好世界",
        "<|endoftext|>",
    ]
    timed = [Timed(w, t, i, i + 1) for i, (w, t) in enumerate(zip(words, tokens))]
    _merge_punctuation(timed)
    merged = [w.word for w in timed if w.word]
    assert merged == [" Hello,", " world!", ' "Quoted"', " (x)", "<|endoftext|>"]
    assert sum((w.tokens for w in timed), []) == [*ids, end]  # every token kept, in order


def test_words_and_times_equal_faster_whisper(tiny_en_url: str, tmp_path: Path) -> None:
    peer = WhisperModel(str(tiny_en_dir()), device="cpu", compute_type="float32")
    compared = 0
    for index in range(4):
        path = tmp_path / f"{index}.wav"
        path.write_bytes(espeak_wav(SENTENCES[index]))
        fields = {
            "model": "whisper-tiny.en",
            "num_beams": "5",
            "response_format": "verbose_json",
            "timestamp_granularities[]": ["word"],
        }
        files = {"file": (path.name, path.read_bytes())}
        r = httpx.post(
            f"{tiny_en_url}/v1/audio/transcriptions", files=files, data=fields, timeout=120
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert "segments" not in body  # only the granularity asked for
        ours = body["words"]
        segments, _ = peer.transcribe(str(path), beam_size=5, word_timestamps=True)
        theirs = [w for segment in segments for w in segment.words or ()]
        if [w["word"] for w in ours] != [w.word.strip() for w in theirs]:
            continue  # the two decoded different words: their times are not comparable
        compared += 1
        assert " ".join(w["word"] for w in ours) == body["text"]
        for word, peer_word in zip(ours, theirs):
            assert abs(word["start"] - peer_word.start) <= 0.1, (word, peer_word)
            assert abs(word["end"] - peer_word.end) <= 0.1, (word, peer_word)
            assert word["start"] <= word["end"]
    assert compared >= 3


def test_the_openai_sdk_reads_words_and_segments(tiny_en_url: str, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{tiny_en_url}/v1", api_key="unused")
    path = tmp_path / "clip.wav"
    path.write_bytes(espeak_wav(SENTENCES[1]))
    with path.open("rb") as audio:
        verbose = client.audio.transcriptions.create(
            model="whisper-tiny.en",
            file=audio,
            response_format="verbose_json",
            timestamp_granularities=["word", "segment"],
        )
    assert verbose.words is not None and verbose.segments is not None
    assert [w.word for w in verbose.words] == verbose.text.split()
    starts = [w.start for w in verbose.words]
    assert starts == sorted(starts) and verbose.words[-1].end <= verbose.duration
    assert verbose.segments[0].start == verbose.words[0].start
    with path.open("rb") as audio, pytest.raises(openai.BadRequestError, match="not streamed"):
        client.audio.transcriptions.create(
            model="whisper-tiny.en",
            file=audio,
            response_format="verbose_json",
            timestamp_granularities=["word"],
            stream=True,
        )
