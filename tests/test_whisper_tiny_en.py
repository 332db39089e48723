"""The PyPI whisper tiny.en (faster-whisper's format, read by the CTranslate2 reader) serving
speech synthesized by espeak-ng: sixteen clips transcribed at once with 5 beams, a word error rate
of at most 10% and within 2 points of faster-whisper's on the same files; the openai SDK's
audio calls, run unchanged against the live server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from faster_whisper import WhisperModel

from benchmarks import speech_clips
from benchmarks.speech_clips import SENTENCES
from server.api.app import create_app
from server.bootstrap import build_serving_context
from server.config import ServerConfig
from tests.audio_files import espeak_wav
from tests.live_server import live_server
from tests.tiny_whisper import build_tiny_whisper, tiny_en_dir

BEAMS = {"num_beams": 5}  # beamline's decoding field: the SDK sends extra_body as form fields


def word_error_rate(hypotheses: list[str], references: list[str] = SENTENCES) -> float:
    return speech_clips.word_error_rate(hypotheses, references)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("speech")
    paths = []
    for i, sentence in enumerate(SENTENCES):
        path = folder / f"{i}.wav"
        path.write_bytes(espeak_wav(sentence))
        paths.append(path)
    return paths


def config(model: Path, cache: Path, name: str) -> ServerConfig:
    return ServerConfig(
        model=str(model),
        served_model_name=name,
        cache_dir=str(cache),
        device="cpu",
        num_kv_blocks=1024,
        block_size=16,
        max_num_batched_tokens=8192,
        engine_process="off",
    )


@pytest.fixture(scope="module")
def tiny_en_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("cache")
    ctx = build_serving_context(config(tiny_en_dir(), cache, "whisper-tiny.en"))
    try:
        with live_server(create_app(ctx=ctx)) as url:
            yield url
    finally:
        ctx.engine.shutdown()


async def test_sixteen_clips_at_once_as_well_as_faster_whisper(
    tiny_en_url: str, clips: list[Path]
) -> None:
    async with httpx.AsyncClient(base_url=tiny_en_url, timeout=120) as client:

        async def transcribe(path: Path) -> str:
            files = {"file": (path.name, path.read_bytes())}
            data = {"model": "whisper-tiny.en", "num_beams": "5"}
            r = await client.post("/v1/audio/transcriptions", files=files, data=data)
            assert r.status_code == 200, r.text
            return str(r.json()["text"])

        ours = await asyncio.gather(*(transcribe(path) for path in clips))
    peer = WhisperModel(str(tiny_en_dir()), device="cpu", compute_type="float32")
    theirs = []
    for path in clips:
        segments, _ = peer.transcribe(str(path), beam_size=5)
        theirs.append(" ".join(segment.text.strip() for segment in segments))
    assert word_error_rate(ours) <= 0.10, ours
    assert word_error_rate(ours) <= word_error_rate(theirs) + 0.02, (ours, theirs)


def test_the_openai_sdk_unchanged(tiny_en_url: str, clips: list[Path]) -> None:
    client = openai.OpenAI(base_url=f"{tiny_en_url}/v1", api_key="unused")
    clip = clips[1]
    with clip.open("rb") as audio:
        text = client.audio.transcriptions.create(
            model="whisper-tiny.en", file=audio, extra_body=BEAMS
        ).text
    assert word_error_rate([text], SENTENCES[1:2]) <= 0.1, text
    with clip.open("rb") as audio:
        plain = client.audio.transcriptions.create(
            model="whisper-tiny.en", file=audio, response_format="text", extra_body=BEAMS
        )
    assert plain.strip() == text
    with clip.open("rb") as audio:
        srt = client.audio.transcriptions.create(
            model="whisper-tiny.en", file=audio, response_format="srt", extra_body=BEAMS
        )
    assert srt.startswith("1\n00:00:00,000 --> ") and text in srt
    with clip.open("rb") as audio:
        verbose = client.audio.transcriptions.create(
            model="whisper-tiny.en",
            file=audio,
            response_format="verbose_json",
            timestamp_granularities=["segment"],
            extra_body=BEAMS,
        )
    assert verbose.text == text and verbose.language == "english"
    assert verbose.segments is not None and verbose.segments[0].text == text
    with clip.open("rb") as audio:
        events = list(
            client.audio.transcriptions.create(
                model="whisper-tiny.en", file=audio, stream=True, extra_body=BEAMS
            )
        )
    assert events[-1].type == "transcript.text.done" and events[-1].text == text
    assert "".join(e.delta for e in events[:-1]).strip() == text
    with clip.open("rb") as audio, pytest.raises(openai.BadRequestError):
        client.audio.translations.create(model="whisper-tiny.en", file=audio)


def test_the_openai_sdk_translates_on_a_multilingual_model(
    tmp_path: Path, clips: list[Path]
) -> None:
    model = build_tiny_whisper(tmp_path / "multi", multilingual=True)
    ctx = build_serving_context(config(model, tmp_path / "cache", "whisper"))
    try:
        with live_server(create_app(ctx=ctx)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            with clips[1].open("rb") as audio:
                translation = client.audio.translations.create(model="whisper", file=audio)
            assert isinstance(translation.text, str) and translation.text
    finally:
        ctx.engine.shutdown()
