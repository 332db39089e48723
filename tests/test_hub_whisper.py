"""faster-whisper's repositories by hub id (`Systran/faster-whisper-tiny.en`): CTranslate2's
`model.bin` with its config and tokenizer, found in a Hugging Face cache built on disk and
served offline (converted once, as a local CTranslate2 directory is), or downloaded alone, its
README and the rest left on the hub."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.speech_clips import SENTENCES, word_error_rate
from server.api.app import create_app
from server.bootstrap import build_serving_context, prepare_model
from server.model.loader import locate_model
from tests import test_hub_models
from tests.audio_files import espeak_wav
from tests.hub_cache import commit_of, model_files, write_snapshot
from tests.test_hub_models import FakeHub, serve_config, use_hub
from tests.tiny_whisper import tiny_en_dir

REPO = "Systran/faster-whisper-tiny.en"
hub_cache, online = test_hub_models.hub_cache, test_hub_models.online  # their fixtures


async def test_a_faster_whisper_repo_from_the_cache_is_served_offline(
    hub_cache: Path, tmp_path: Path
) -> None:
    files = model_files(tiny_en_dir())
    snapshot = write_snapshot(hub_cache, REPO, files, commit_of("ct2"), refs=("main",))
    config = prepare_model(
        serve_config(REPO, cache_dir=str(tmp_path / "cache"), num_kv_blocks=640, block_size=16)
    )
    assert (Path(config.model or ""), config.served_model_name) == (snapshot, REPO)
    ctx = build_serving_context(config)
    try:
        assert ctx.speech is not None
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            files_field = {"file": ("clip.wav", espeak_wav(SENTENCES[1]))}
            r = await client.post(
                "/v1/audio/transcriptions",
                files=files_field,
                data={"model": REPO, "num_beams": "5"},
                timeout=120,
            )
        assert r.status_code == 200, r.text
        assert word_error_rate([r.json()["text"]], SENTENCES[1:2]) <= 0.1, r.text
    finally:
        ctx.engine.shutdown()


def test_online_only_the_files_faster_whisper_serves_are_downloaded(
    hub_cache: Path, online: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("README.md", ".gitattributes"):
        (repo / name).write_text("not served")
    files = {**model_files(tiny_en_dir()), **model_files(repo)}
    fake = use_hub(monkeypatch, FakeHub(hub_cache, files))
    located = locate_model(REPO)
    assert sorted(fake.downloaded) == [
        "config.json",
        "model.bin",
        "tokenizer.json",
        "vocabulary.txt",
    ]
    assert located.path.name == fake.commit
