"""A Whisper model behind OpenAI's audio routes (a tiny random Whisper started as `beamline
serve` starts it): uploads of every container decoded, the transcript token-exact against
`generate()` of the same audio (greedy, beams, an earlier-text prompt, a detected language), in
every response format and streamed; hostile uploads a clear 4xx with the server still serving."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

from server.api.app import create_app
from server.api.serving import ServingContext
from server.audio.decode import decode_audio
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig
from tests.audio_files import CONTAINERS, encode, tone
from tests.conftest import started_client
from tests.tiny_whisper import build_tiny_whisper

AUDIO = tone(3.0)
# the random model never ends a window: 128 decoder positions (Whisper's are 448) decode one sooner
POSITIONS = {"max_target_positions": 128}
WAV = encode(AUDIO, "wav")


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper_api") / "tiny", **POSITIONS)


@pytest.fixture(scope="module")
def multilingual_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whisper_api") / "multi"
    return build_tiny_whisper(path, multilingual=True, **POSITIONS)


def settings() -> dict:
    return dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=4096, max_audio_seconds=40)


@pytest.fixture
async def client(whisper_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with started_client(whisper_dir, "whisper", **settings()) as c:
        yield c


def generated(model_dir: Path, samples: np.ndarray, **kwargs: object) -> list[int]:
    """`generate()`'s tokens for `samples`: every pass over the audio's windows (short audio: one
    padded window, decoded again from its last closed segment where a pass ends inside one, as
    a random model's often do), its end of text taken off."""
    extractor = WhisperFeatureExtractor.from_pretrained(model_dir)
    long = samples.shape[0] > extractor.n_samples
    features = extractor(
        samples,
        sampling_rate=16_000,
        return_tensors="pt",
        **({"padding": "longest", "truncation": False} if long else {}),
    ).input_features
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(features, **kwargs)
    tokens = out[0].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def expected(model_dir: Path, samples: np.ndarray, **kwargs: object) -> str:
    """`generate()`'s transcript of `samples`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = generated(model_dir, samples, **kwargs)
    return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def upload(data: bytes = WAV, name: str = "audio.wav", **fields: object) -> dict:
    """A form as the SDK sends it. The random model's windows fail every fallback threshold:
    unless a test says otherwise they are decoded once, as `generate()` decodes by default."""
    form = {"model": "whisper", "temperature_increment_on_fallback": 0, **fields}
    return {"files": {"file": (name, data)}, "data": {k: str(v) for k, v in form.items()}}


async def transcribe(client: httpx.AsyncClient, **kwargs: object) -> httpx.Response:
    return await client.post("/v1/audio/transcriptions", **upload(**kwargs))


async def test_a_transcript_is_generates_text(client: httpx.AsyncClient, whisper_dir: Path) -> None:
    r = await transcribe(client)
    assert r.status_code == 200, r.text
    text = expected(whisper_dir, decode_audio(WAV, 30))
    assert r.json() == {"text": text, "usage": {"type": "duration", "seconds": 3}}
    assert text  # the random model says something


async def test_beams_and_a_previous_text_prompt_are_generates(
    client: httpx.AsyncClient, whisper_dir: Path
) -> None:
    samples = decode_audio(WAV, 30)
    r = await transcribe(client, num_beams=5)
    assert r.json()["text"] == expected(whisper_dir, samples, num_beams=5)
    tokenizer = AutoTokenizer.from_pretrained(whisper_dir)
    prompt_ids = torch.tensor(
        [tokenizer.convert_tokens_to_ids("<|startofprev|>")]
        + tokenizer(" Earlier words.", add_special_tokens=False).input_ids
    )
    r = await transcribe(client, prompt="Earlier words.")
    assert r.json()["text"] == expected(whisper_dir, samples, prompt_ids=prompt_ids)


@pytest.mark.timeout(180)
async def test_the_engine_process_gets_the_audio_too(whisper_dir: Path) -> None:
    """The window's features cross the pipe to the engine process with the request (and a
    window's cross-attention scores come back)."""
    async with started_client(whisper_dir, "whisper", engine_process="on", **settings()) as c:
        r = await transcribe(c)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected(whisper_dir, decode_audio(WAV, 30))
        # and the cross-attention scores of word timestamps come back through it
        fields = {"response_format": "verbose_json", "timestamp_granularities[]": "word"}
        r = await transcribe(c, **fields)
        assert r.status_code == 200, r.text
        words = r.json()["words"]
        assert words and all(0 <= w["start"] <= w["end"] <= 30 for w in words), words


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
async def test_every_container_is_decoded(client: httpx.AsyncClient, kind: str) -> None:
    data = encode(AUDIO, kind)
    r = await transcribe(client, data=data, name=f"audio.{kind}", response_format="text")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    lossless = kind in ("wav", "flac")
    if lossless:  # the same samples: the same transcript
        assert r.text == (await transcribe(client, response_format="text")).text


async def test_the_response_formats(client: httpx.AsyncClient, whisper_dir: Path) -> None:
    samples = decode_audio(WAV, 30)
    text = expected(whisper_dir, samples)
    r = await transcribe(client, response_format="text")
    assert r.text == text + "\n"
    # the formats with times decode with timestamps, token for token as generate() does
    tokens = generated(whisper_dir, samples, return_timestamps=True)
    r = await transcribe(
        client, response_format="verbose_json", **{"timestamp_granularities[]": "segment"}
    )
    body = r.json()
    assert (body["task"], body["language"], body["duration"]) == ("transcribe", "english", 3.0)
    segments = body["segments"]
    assert [t for s in segments for t in s["tokens"]] == tokens
    assert len(segments) > 1 and segments[0]["start"] <= 1.0  # max_initial_timestamp_index
    for before, after in zip(segments, segments[1:]):
        assert before["start"] <= before["end"] <= after["start"] <= after["end"]
    assert body["text"].replace(" ", "") == "".join(s["text"] for s in segments).replace(" ", "")
    r = await transcribe(client, response_format="srt")
    cues = r.text.strip().split("\n\n")
    assert len(cues) == len(segments)
    first = cues[0].split("\n")
    assert first[0] == "1" and re.fullmatch(r"00:00:0\d,\d{3} --> 00:00:0\d,\d{3}", first[1])
    assert first[2] == segments[0]["text"]
    r = await transcribe(client, response_format="vtt")
    assert re.match(r"WEBVTT\n\n00:00:0\d\.\d{3} --> ", r.text)
    assert r.text.count(" --> ") == len(segments)


async def test_a_stream_sends_deltas_then_the_whole_text(
    client: httpx.AsyncClient, whisper_dir: Path
) -> None:
    text = expected(whisper_dir, decode_audio(WAV, 30))
    r = await transcribe(client, stream="true")
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    assert deltas and "".join(deltas).strip() == text  # a delta per window
    assert events[-1] == {"type": "transcript.text.done", "text": text}


async def test_long_audio_is_decoded_window_by_window_as_generate_does(
    client: httpx.AsyncClient, whisper_dir: Path
) -> None:
    long = tone(36.0, seed=1)
    samples = decode_audio(encode(long, "flac"), 40)
    r = await transcribe(client, data=encode(long, "flac"), name="long.flac")
    assert r.status_code == 200, r.text
    assert r.json()["text"] == expected(whisper_dir, samples, return_timestamps=True)
    r = await transcribe(
        client, data=encode(long, "flac"), name="long.flac", response_format="verbose_json"
    )
    segments = r.json()["segments"]
    tokens = generated(whisper_dir, samples, return_timestamps=True)
    assert [t for s in segments for t in s["tokens"]] == tokens
    assert segments[-1]["end"] > 30  # the second window's
    assert segments[0]["seek"] == 0 < segments[-1]["seek"] < 3000
    r = await transcribe(
        client, data=encode(long, "flac"), name="long.flac", condition_on_previous_text="true"
    )
    conditioned = expected(
        whisper_dir, samples, return_timestamps=True, condition_on_prev_tokens=True
    )
    assert r.json()["text"] == conditioned != expected(whisper_dir, samples, return_timestamps=True)


async def test_a_multilingual_model_detects_the_language_and_translates(
    multilingual_dir: Path,
) -> None:
    samples = decode_audio(WAV, 30)
    tokenizer = AutoTokenizer.from_pretrained(multilingual_dir)
    async with started_client(multilingual_dir, "whisper", **settings()) as client:
        r = await transcribe(client)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected(multilingual_dir, samples)  # detects, as generate()
        r = await transcribe(client, response_format="verbose_json")
        assert r.json()["language"] in ("english", "german", "french")
        r = await transcribe(client, language="de")
        assert r.json()["text"] == expected(multilingual_dir, samples, language="de")
        # detected from `<|startoftranscript|>` alone, the prompt before the window's tokens
        prompt_ids = torch.tensor(
            [tokenizer.convert_tokens_to_ids("<|startofprev|>")]
            + tokenizer(" Earlier words.", add_special_tokens=False).input_ids
        )
        r = await transcribe(client, prompt="Earlier words.")
        assert r.json()["text"] == expected(multilingual_dir, samples, prompt_ids=prompt_ids)
        r = await client.post("/v1/audio/translations", **upload())
        assert r.status_code == 200, r.text
        assert r.json()["text"] == expected(multilingual_dir, samples, task="translate")
        r = await transcribe(client, language="xx")
        assert r.status_code == 400 and r.json()["error"]["param"] == "language"


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        (dict(data=b""), "file", "empty"),
        (dict(data=b"not audio at all " * 64), "file", "could not be read as audio"),
        (dict(data=encode(tone(41.0), "flac")), "file", "longer than"),
        (dict(response_format="xml"), "response_format", "verbose_json"),
        (dict(temperature=2), "temperature", "less than or equal"),
        (dict(num_beams=0), "num_beams", "greater than or equal"),
        (dict(num_beams=6), "num_beams", "KV-cache blocks"),  # 6 windows > the pool's 512
        (dict(colour="red"), "colour", "unknown field"),
        (dict(language="fr"), "language", "English-only"),
        (dict(**{"timestamp_granularities[]": "word"}), "timestamp_granularities", "verbose_json"),
        (
            dict(
                response_format="verbose_json",
                stream="true",
                **{"timestamp_granularities[]": "word"},
            ),
            "timestamp_granularities",
            "not streamed",
        ),
    ],
)
async def test_a_hostile_upload_is_a_400_and_the_server_serves_on(
    client: httpx.AsyncClient, kwargs: dict, param: str, fragment: str
) -> None:
    r = await transcribe(client, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert (await client.get("/health")).status_code == 200  # its engine alive


async def test_what_is_not_an_upload_is_refused(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/audio/transcriptions", json={"model": "whisper"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    r = await client.post("/v1/audio/transcriptions", data={"model": "whisper"}, files={})
    assert r.status_code == 400
    r = await client.post(
        "/v1/audio/transcriptions", files={"x": ("a", b"1")}, data={"model": "whisper"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = await client.post("/v1/audio/translations", **upload())  # tiny.en's vocabulary
    assert r.status_code == 400 and "English-only" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": "whisper", "prompt": "hi"})
    assert r.status_code == 400 and "/v1/audio/transcriptions" in r.json()["error"]["message"]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "whisper", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400


async def test_an_upload_over_the_audio_limit_is_a_413(whisper_dir: Path) -> None:
    async with started_client(
        whisper_dir, "whisper", max_audio_bytes=128 * 1024, **settings()
    ) as client:
        assert (await transcribe(client)).status_code == 200  # 96 kB
        r = await transcribe(client, data=encode(tone(5.0), "wav"))  # 160 kB
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


async def test_the_audio_routes_on_a_text_model_say_so(tiny_ctx: ServingContext) -> None:
    transport = httpx.ASGITransport(app=create_app(ctx=tiny_ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as text_model:
        r = await text_model.post("/v1/audio/transcriptions", **upload())
    assert r.status_code == 400 and "speech model" in r.json()["error"]["message"]


async def test_metrics_count_the_audio_and_its_real_time_factor(
    client: httpx.AsyncClient,
) -> None:
    assert (await transcribe(client)).status_code == 200
    assert (await transcribe(client, stream="true")).status_code == 200
    text = (await client.get("/metrics")).text
    assert 'beamline:audio_seconds_total{model_name="whisper",task="transcribe"} 6.0' in text
    assert 'beamline:audio_seconds_total{model_name="whisper",task="translate"} 0.0' in text
    assert 'beamline:audio_real_time_factor_count{model_name="whisper"} 2.0' in text


@pytest.mark.parametrize(
    ("flags", "named"),
    [({"torch_compile": True}, "torch_compile"), ({"quantization": "int8"}, "quantization int8")],
)
def test_settings_whisper_does_not_run_with_are_refused_by_name(
    whisper_dir: Path, flags: dict, named: str
) -> None:
    config = ServerConfig(
        model=str(whisper_dir), device="cpu", num_kv_blocks=256, engine_process="off", **flags
    )
    with pytest.raises(ModelLoadFailed) as failed:
        build_serving_context(config)
    assert "Whisper models do not run with" in str(failed.value) and named in str(failed.value)


def test_a_kv_pool_that_cannot_hold_a_window_is_refused_at_start_up(whisper_dir: Path) -> None:
    config = ServerConfig(
        model=str(whisper_dir), device="cpu", num_kv_blocks=64, block_size=16, engine_process="off"
    )
    with pytest.raises(ModelLoadFailed, match="one window of this speech model needs 102"):
        build_serving_context(config)
