"""Temperature fallback as `generate()` does it for Whisper: its measures (the compression ratio
of the token ids, the average processed log-probability, a beam's score, the no-speech
probability) equal generate()'s, so a window is decoded again, or skipped as silence, exactly
where generate() would. A tiny random Whisper behind the audio route; the thresholds are put
just either side of generate()'s own values for the same audio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from server.audio.decode import decode_audio
from server.audio.fallback import Attempt, FallbackRules, compression_ratio
from tests.audio_files import encode, tone
from tests.conftest import started_client
from tests.tiny_whisper import build_tiny_whisper

WAV = encode(tone(3.0), "wav")
LOOSE = {"compression_ratio_threshold": 1e9, "logprob_threshold": -1e9}


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whisper_fallback") / "tiny"
    return build_tiny_whisper(path, max_target_positions=96)


@pytest.fixture(scope="module")
def measured(whisper_dir: Path) -> dict:
    """generate()'s tokens of the window (greedy and 5 beams, no timestamps), and what its
    fallback measures of them."""
    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    features = extractor(
        decode_audio(WAV, 30), sampling_rate=16_000, return_tensors="pt"
    ).input_features
    config = model.generation_config
    found: dict = {}
    with torch.no_grad():
        greedy = model.generate(features, return_dict_in_generate=True, output_scores=True)
        beams = model.generate(
            features, num_beams=5, return_dict_in_generate=True, output_scores=True
        )
        prompt = torch.tensor([[config.decoder_start_token_id, config.no_timestamps_token_id]])
        logits = model(input_features=features, decoder_input_ids=prompt).logits
    scores = [s[0] for s in greedy.scores]
    tokens = greedy.sequences[0, -len(scores) :]
    mixin = WhisperGenerationMixin
    found["greedy"] = tokens.tolist()
    found["avg_logprob"] = float(mixin._retrieve_avg_logprobs(scores, tokens, 0.0))
    found["ratio"] = mixin._retrieve_compression_ratio(tokens, model.config.vocab_size)
    found["beams"] = beams.sequences[0, 2:].tolist()
    found["beam_score"] = float(beams.sequences_scores[0])
    found["no_speech"] = float(logits[0, 0].softmax(-1)[config.no_timestamps_token_id - 1])
    found["text"] = {
        key: str(
            AutoTokenizer.from_pretrained(whisper_dir).decode(found[key], skip_special_tokens=True)
        ).strip()
        for key in ("greedy", "beams")
    }
    return found


@pytest.fixture
async def client(whisper_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=4096)
    async with started_client(whisper_dir, "whisper", **settings) as c:
        yield c


async def transcribe(client: httpx.AsyncClient, **fields: object) -> dict:
    """The window at temperature 0, then (where it fails) 1; json unless asked otherwise."""
    form = {"model": "whisper", "temperature_increment_on_fallback": 1.0, **fields}
    r = await client.post(
        "/v1/audio/transcriptions",
        files={"file": ("a.wav", WAV)},
        data={k: str(v) for k, v in form.items()},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_the_measures_are_generates() -> None:
    tokens = [50257, 50362, 40577, 6891, 39110, 6891, 6891, 6891, 6891, 50256]
    assert compression_ratio(tokens, 51864) == WhisperGenerationMixin._retrieve_compression_ratio(
        torch.tensor(tokens), 51864
    )
    scores = [torch.randn(51864) for _ in tokens]
    processed = [float(torch.log_softmax(s, -1)[t]) for s, t in zip(scores, tokens)]
    attempt = Attempt(tokens, processed, None, 0.0)
    reference = WhisperGenerationMixin._retrieve_avg_logprobs(scores, torch.tensor(tokens), 0.0)
    assert attempt.avg_logprob == pytest.approx(float(reference), rel=1e-6)
    assert Attempt(tokens, processed, -0.5, 0.0).avg_logprob == -0.5  # beams: their score
    rules = FallbackRules.of(0.0, 0.2, 1.35, -1.0, 0.6)
    assert rules.temperatures == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert FallbackRules.of(0.3, 0.0, 1.35, -1.0, 0.6).temperatures == (0.3,)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("beams", [1, 5])
async def test_a_window_is_decoded_again_exactly_where_generate_would(
    client: httpx.AsyncClient, measured: dict, beams: int
) -> None:
    kept = measured["text"]["beams" if beams > 1 else "greedy"]
    average = measured["beam_score" if beams > 1 else "avg_logprob"]
    strategy = {"num_beams": beams}
    passes = await transcribe(client, **strategy, **{**LOOSE, "logprob_threshold": average - 1e-3})
    assert passes["text"] == kept
    unlikely = await transcribe(
        client, **strategy, **{**LOOSE, "logprob_threshold": average + 1e-3}
    )
    assert unlikely["text"] != kept  # sampled again at temperature 1
    ratio = measured["ratio"]
    if beams == 1:
        fine = await transcribe(client, **{**LOOSE, "compression_ratio_threshold": ratio + 1e-3})
        assert fine["text"] == kept
        repeats = await transcribe(client, **{**LOOSE, "compression_ratio_threshold": ratio - 1e-3})
        assert repeats["text"] != kept


@pytest.mark.timeout(300)
async def test_an_unlikely_window_where_no_speech_is_likely_is_skipped(
    client: httpx.AsyncClient, measured: dict, whisper_dir: Path
) -> None:
    p = measured["no_speech"]
    unlikely = {"compression_ratio_threshold": 1e9, "logprob_threshold": 0.0}
    skipped = await transcribe(client, **unlikely, no_speech_threshold=p * 0.999)
    assert skipped["text"] == ""
    heard = await transcribe(client, **unlikely, no_speech_threshold=p * 1.001)
    assert heard["text"] != ""
    # generate() skips it too
    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    features = extractor(
        decode_audio(WAV, 30), sampling_rate=16_000, return_tensors="pt"
    ).input_features
    with torch.no_grad():
        out = model.generate(
            features,
            temperature=(0.0, 1.0),
            logprob_threshold=0.0,
            no_speech_threshold=p * 0.999,
            compression_ratio_threshold=1e9,
        )
    assert out.shape[-1] == 0 or set(out[0].tolist()) <= {model.generation_config.pad_token_id}
    # verbose_json reports the window's no-speech probability and the kept attempt's temperature
    body = await transcribe(client, response_format="verbose_json", **LOOSE)
    segment = body["segments"][0]
    assert segment["no_speech_prob"] == pytest.approx(p, rel=1e-4)
    assert segment["temperature"] == 0.0
    body = await transcribe(
        client, response_format="verbose_json", **{**LOOSE, "logprob_threshold": 0.0}
    )
    assert {s["temperature"] for s in body["segments"]} == {1.0}
