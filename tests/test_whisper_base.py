"""Whisper base, multilingual, from its two PyPI packages (faster-whisper's format, `model.bin`
split in two): read whole through its parts, it detects English and German speech synthesized by
espeak-ng, and transcribes eight English sentences with a word error rate of at most 15% (11%
when written; its tokens are generate()'s, which the tiny models' tests check)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from benchmarks.speech_clips import SENTENCES, word_error_rate
from server.api.app import create_app
from server.bootstrap import build_serving_context
from server.config import ServerConfig
from tests.audio_files import espeak_wav
from tests.live_server import live_server
from tests.tiny_whisper import pypi_whisper_base

ENGLISH = SENTENCES[:8]
GERMAN = "Das Wetter ist heute sonnig und es weht ein leichter Wind aus Westen."


@pytest.mark.timeout(600)
async def test_whisper_base_from_its_two_packages(tmp_path: Path) -> None:
    model = pypi_whisper_base(tmp_path / "whisper-base")
    config = ServerConfig(
        model=str(model),
        served_model_name="whisper-base",
        cache_dir=str(tmp_path / "cache"),
        device="cpu",
        num_kv_blocks=1024,
        block_size=16,
        max_num_batched_tokens=8192,
        engine_process="off",
    )
    clips = [espeak_wav(text) for text in ENGLISH]
    german = espeak_wav(GERMAN, voice="de")
    ctx = build_serving_context(config)
    try:
        with live_server(create_app(ctx=ctx)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:

                async def transcribe(clip: bytes) -> dict:
                    files = {"file": ("clip.wav", clip)}
                    form = {"model": "whisper-base", "num_beams": "5"}
                    data = {**form, "response_format": "verbose_json"}
                    r = await client.post("/v1/audio/transcriptions", files=files, data=data)
                    assert r.status_code == 200, r.text
                    return r.json()

                heard = await asyncio.gather(*(transcribe(clip) for clip in [*clips, german]))
    finally:
        ctx.engine.shutdown()
    assert [h["language"] for h in heard] == ["english"] * len(ENGLISH) + ["german"]
    ours = [h["text"] for h in heard[: len(ENGLISH)]]
    assert word_error_rate(ours, ENGLISH) <= 0.15, ours
