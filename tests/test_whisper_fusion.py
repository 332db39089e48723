"""LM fusion on the audio routes: a tiny random Whisper with a tiny language model of Whisper's
vocabulary fused into every step (shallow fusion, the classic way to adapt speech recognition to
a domain), token-exact against `generate()` with a logits processor that adds the LM's log-probs
of the decoder's tokens; a bad `lm_fusion` form field is a 400."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from server.audio.decode import decode_audio
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig
from tests.conftest import started_client
from tests.test_lm_fusion import FusedScores
from tests.test_whisper_api import POSITIONS, WAV, generated, settings, transcribe
from tests.tiny_whisper import build_tiny_whisper


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("whisper_fusion")
    whisper = build_tiny_whisper(root / "whisper", **POSITIONS)
    lm = root / "lm"  # a language model with Whisper's tokenizer
    config = LlamaConfig(
        vocab_size=51864,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,  # strong enough opinions to change the transcript
    )
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(lm)
    AutoTokenizer.from_pretrained(whisper).save_pretrained(lm)
    return {"whisper": whisper, "lm": lm}


@pytest.fixture
async def client(dirs: dict[str, Path]) -> AsyncIterator[httpx.AsyncClient]:
    extra = {"extra_models": [f"lm={dirs['lm']}"]}
    async with started_client(dirs["whisper"], "whisper", **settings(), **extra) as c:
        yield c


@pytest.mark.parametrize("weight", [0.5, -0.4])
async def test_a_fused_transcript_is_generates_with_the_lm_processor(
    client: httpx.AsyncClient, dirs: dict[str, Path], weight: float
) -> None:
    """Greedy: the fused scores' argmax is generate()'s, whose own suppressions come before the
    processor (a log_softmax over fewer tokens shifts a row by a constant)."""
    fusion = json.dumps({"model": "lm", "weight": weight})
    r = await transcribe(client, lm_fusion=fusion)
    assert r.status_code == 200, r.text
    lm = LlamaForCausalLM.from_pretrained(dirs["lm"]).eval()
    processors = LogitsProcessorList([FusedScores(lm, weight)])
    samples = decode_audio(WAV, 30)
    tokens = generated(dirs["whisper"], samples, logits_processor=processors)
    tokenizer = AutoTokenizer.from_pretrained(dirs["whisper"])
    text = str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()
    assert r.json()["text"] == text
    plain = await transcribe(client)
    assert plain.json()["text"] != text  # the LM changed the transcript


async def test_a_bad_lm_fusion_field_is_a_400(client: httpx.AsyncClient) -> None:
    for value, param in (
        ("{not json", "lm_fusion"),
        (json.dumps({"model": "lm", "weight": "inf"}), "lm_fusion.weight"),
        (json.dumps({"model": "nope", "weight": 1}), "lm_fusion.model"),
    ):
        r = await transcribe(client, lm_fusion=value)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    assert (await transcribe(client)).status_code == 200


def test_an_lm_with_fewer_positions_than_the_decoder_is_refused(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A fused row's decoder tokens all run through the LM: it must have the decoder's
    positions (the source's do not count)."""
    short = tmp_path / "short"
    config = LlamaConfig.from_pretrained(dirs["lm"])
    config.max_position_embeddings = POSITIONS["max_target_positions"] - 1
    LlamaForCausalLM(config).save_pretrained(short)
    AutoTokenizer.from_pretrained(dirs["whisper"]).save_pretrained(short)
    config = ServerConfig(
        model=str(dirs["whisper"]), device="cpu", extra_models=[f"lm={short}"], **settings()
    )
    with pytest.raises(ModelLoadFailed, match="has 127 positions and the served model's decoder"):
        build_serving_context(config)
