"""An encoder-decoder model behind the OpenAI routes (a tiny random BART, started as `beamline
serve` starts it): a completion's prompt is the source, its text and usage as `generate()` and
the source say, streaming or not, beams included; what does not apply is a 400 that says what to
use, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    NllbTokenizerFast,
)

from server.api.app import create_app
from server.api.serving import ServingContext
from server.bootstrap import ModelLoadFailed, build_serving_context
from server.config import ServerConfig
from tests.conftest import started_client
from tests.tiny_seq2seq import build_tiny_seq2seq

SOURCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_seq2seq(tmp_path_factory.mktemp("seq2seq_api") / "bart", "bart")


@pytest.fixture
async def client(bart_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with started_client(bart_dir, "bart") as c:
        yield c


def expected_texts(bart_dir: Path, **kwargs: object) -> list[str]:
    model = AutoModelForSeq2SeqLM.from_pretrained(bart_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([tokenizer(SOURCE).input_ids]), do_sample=False, **kwargs)
    return [tokenizer.decode(row[1:], skip_special_tokens=True) for row in out]


async def test_a_completion_reads_its_prompt_as_the_source(
    client: httpx.AsyncClient, bart_dir: Path
) -> None:
    body = {"model": "bart", "prompt": SOURCE, "max_tokens": 10, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["text"] for c in answer["choices"]] == expected_texts(bart_dir, max_new_tokens=10)
    source_tokens = len(AutoTokenizer.from_pretrained(bart_dir)(SOURCE).input_ids)
    assert answer["usage"]["prompt_tokens"] == source_tokens  # the source, not the decoder's start
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [
        json.loads(line[6:])
        for line in streamed.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]


@pytest.mark.timeout(180)
async def test_the_engine_process_gets_the_source_too(bart_dir: Path) -> None:
    body = {"model": "bart", "prompt": SOURCE, "max_tokens": 10, "temperature": 0}
    async with started_client(bart_dir, "bart", engine_process="on") as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert [ch["text"] for ch in r.json()["choices"]] == expected_texts(
            bart_dir, max_new_tokens=10
        )
        source_tokens = len(AutoTokenizer.from_pretrained(bart_dir)(SOURCE).input_ids)
        assert r.json()["usage"]["prompt_tokens"] == source_tokens


async def test_beam_search_returns_generates_beams(
    client: httpx.AsyncClient, bart_dir: Path
) -> None:
    body = {"model": "bart", "prompt": SOURCE, "max_tokens": 8, "num_beams": 4, "n": 2}
    r = await client.post("/v1/completions", json={**body, "temperature": 0})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == expected_texts(bart_dir, max_new_tokens=8, num_beams=4, num_return_sequences=2)


@pytest.mark.parametrize(
    "route, body, param, code",
    [
        ("completions", {"prompt": "fox " * 200}, "prompt", "source_too_long"),
        ("completions", {"prompt": ""}, "prompt", "empty_prompt"),
        ("completions", {"prompt": []}, "prompt", "empty_prompt"),
        ("completions", {"prompt": SOURCE, "echo": True}, "echo", "unsupported"),
        ("completions", {"prompt": SOURCE, "prompt_logprobs": 1}, "prompt_logprobs", "unsupported"),
        ("completions", {"prompt": SOURCE, "max_tokens": 500}, "max_tokens", "invalid_value"),
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages", None),
    ],
    ids=[
        "source-too-long",
        "empty-text",
        "empty-ids",
        "echo",
        "prompt-logprobs",
        "max-tokens",
        "chat",
    ],
)
async def test_what_does_not_apply_to_a_source_is_a_400_and_the_server_serves_on(
    client: httpx.AsyncClient, route: str, body: dict, param: str, code: str | None
) -> None:
    r = await client.post(f"/v1/{route}", json={"model": "bart", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["code"] == (code or "unsupported_model")
    if route == "chat/completions":
        assert "send the source as the prompt of /v1/completions" in error["message"]
    ok = await client.post(
        "/v1/completions", json={"model": "bart", "prompt": SOURCE, "max_tokens": 3}
    )
    assert ok.status_code == 200, ok.text


def test_start_up_names_the_generation_fields_it_does_not_apply(
    bart_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "bart"
    shutil.copytree(bart_dir, model)
    GenerationConfig(
        decoder_start_token_id=2, num_beams=4, suppress_tokens=[5], forced_bos_token_id=0
    ).save_pretrained(model)
    config = ServerConfig(model=str(model), device="cpu", num_kv_blocks=64, engine_process="off")
    with caplog.at_level("WARNING", logger="server.bootstrap"):
        ctx = build_serving_context(config)
    ctx.engine.shutdown()
    warned = [r.getMessage() for r in caplog.records if r.name == "server.bootstrap"]
    assert warned == [
        "the model's generation_config.json sets suppress_tokens [5], which generate() applies "
        "and beamline does not yet for encoder-decoder models: set the decoding fields in "
        "requests"
    ]


GENERATION = dict(
    decoder_start_token_id=2,
    eos_token_id=2,
    pad_token_id=0,
    num_beams=3,
    length_penalty=0.8,
    early_stopping=True,
    no_repeat_ngram_size=2,
    min_length=4,
    max_length=9,
    forced_bos_token_id=42,
    bad_words_ids=[[43]],
)


@pytest.fixture
async def configured(bart_dir: Path, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The tiny BART with a generation config that sets what a real checkpoint sets."""
    model = tmp_path / "bart"
    shutil.copytree(bart_dir, model)
    GenerationConfig(**GENERATION).save_pretrained(model)
    async with started_client(model, "bart") as c:
        yield c


async def test_a_request_that_sets_nothing_decodes_as_generate_with_the_models_config(
    configured: httpx.AsyncClient, bart_dir: Path
) -> None:
    r = await configured.post("/v1/completions", json={"model": "bart", "prompt": SOURCE})
    assert r.status_code == 200, r.text
    model = AutoModelForSeq2SeqLM.from_pretrained(bart_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(bart_dir)
    with torch.no_grad():  # generate() with that generation config and nothing else
        out = model.generate(
            torch.tensor([tokenizer(SOURCE).input_ids]),
            generation_config=GenerationConfig(**GENERATION),
        )
        overridden = model.generate(  # a request's own fields win over the config's
            torch.tensor([tokenizer(SOURCE).input_ids]),
            generation_config=GenerationConfig(**GENERATION),
            num_beams=1,
            max_new_tokens=5,
        )
    ids = out[0, 1:].tolist()
    ids = ids[: ids.index(2) + 1] if 2 in ids else ids  # padding after the EOS
    assert ids[0] == 42  # the forced first token
    assert r.json()["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert r.json()["usage"]["completion_tokens"] == len(ids)
    explicit = await configured.post(
        "/v1/completions",
        json={"model": "bart", "prompt": SOURCE, "num_beams": 1, "max_tokens": 5},
    )
    assert explicit.status_code == 200, explicit.text
    text = tokenizer.decode(overridden[0, 1:], skip_special_tokens=True)
    assert explicit.json()["choices"][0]["text"] == text


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny M2M100 (NLLB's architecture) with NLLB's tokenizer class and its 202 language
    codes (an empty vocabulary otherwise: words are unknown tokens, languages are not)."""
    path = tmp_path_factory.mktemp("nllb") / "nllb"
    return build_tiny_seq2seq(path, "m2m_100", tokenizer=NllbTokenizerFast())


@pytest.fixture
async def nllb(nllb_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with started_client(nllb_dir, "bart") as c:
        yield c


async def test_src_and_tgt_lang_translate_as_the_translation_pipeline_does(
    nllb: httpx.AsyncClient, nllb_dir: Path
) -> None:
    body = {
        "model": "bart",
        "prompt": "Bonjour le monde",
        "src_lang": "fra_Latn",
        "tgt_lang": "deu_Latn",
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = await nllb.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(nllb_dir)
    inputs = tokenizer._build_translation_inputs(
        "Bonjour le monde", "pt", src_lang="fra_Latn", tgt_lang="deu_Latn"
    )
    model = AutoModelForSeq2SeqLM.from_pretrained(nllb_dir).eval()
    with torch.no_grad():
        out = model.generate(
            inputs["input_ids"],
            forced_bos_token_id=inputs["forced_bos_token_id"],
            max_new_tokens=8,
            do_sample=False,
        )
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert choice["prompt_token_ids"][0] == tokenizer.convert_tokens_to_ids("fra_Latn")
    assert choice["token_ids"] == out[0, 1:].tolist()
    assert choice["token_ids"][0] == tokenizer.convert_tokens_to_ids("deu_Latn")
    plain = await nllb.post(  # the server's tokenizer was put back to its own src_lang
        "/v1/completions", json={**body, "src_lang": None, "return_token_ids": True}
    )
    assert plain.json()["choices"][0]["prompt_token_ids"][0] == (
        tokenizer.convert_tokens_to_ids("eng_Latn")
    )


@pytest.mark.parametrize(
    "fields, param, code, says",
    [
        ({"tgt_lang": "klingon"}, "tgt_lang", "invalid_value", "its codes: ace_Arab, ace_Latn"),
        ({"src_lang": "xx"}, "src_lang", "invalid_value", "not a language code"),
        (
            {"src_lang": "fra_Latn", "prompt": [5, 6, 2]},
            "src_lang",
            "invalid_value",
            "applies to a text prompt",
        ),
    ],
)
async def test_a_language_the_tokenizer_does_not_know_is_a_400_listing_those_it_does(
    nllb: httpx.AsyncClient, fields: dict, param: str, code: str, says: str
) -> None:
    body = {"model": "bart", "prompt": "Bonjour", "max_tokens": 2, **fields}
    r = await nllb.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert says in error["message"]


async def test_languages_on_a_model_without_language_codes_are_a_400(
    client: httpx.AsyncClient, tiny_client: httpx.AsyncClient
) -> None:
    # a BART with a plain tokenizer; a decoder-only model
    for c, model in ((client, "bart"), (tiny_client, "tiny")):
        r = await c.post(
            "/v1/completions", json={"model": model, "prompt": "Hi", "tgt_lang": "deu_Latn"}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("tgt_lang", "unsupported")
        assert (
            "applies to translation models whose tokenizer has language codes" in (error["message"])
        )


@pytest.fixture
async def tiny_client(tiny_ctx: ServingContext) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(ctx=tiny_ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def test_a_json_schema_constrains_a_t5_output(tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"animal": {"enum": ["fox", "dog"]}, "count": {"type": "integer"}},
        "required": ["animal", "count"],
        "additionalProperties": False,
    }
    t5 = build_tiny_seq2seq(tmp_path / "t5", "t5")
    async with started_client(t5, "bart") as c:
        for strategy in ({"temperature": 0}, {"num_beams": 3, "n": 2, "temperature": 0}):
            r = await c.post(
                "/v1/completions",
                json={
                    "model": "bart",
                    "prompt": SOURCE,
                    "max_tokens": 40,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "a", "schema": schema},
                    },
                    **strategy,
                },
            )
            assert r.status_code == 200, r.text
            for choice in r.json()["choices"]:
                jsonschema.validate(json.loads(choice["text"]), schema)


@pytest.mark.parametrize(
    "flags, named",
    [
        ({"enable_lora": True}, "LoRA adapters"),
        ({"async_scheduling": "on", "attention_backend": "triton"}, "attention_backend triton"),
    ],
)
def test_settings_it_does_not_run_with_are_refused_at_start_up_by_name(
    bart_dir: Path, flags: dict, named: str
) -> None:
    config = ServerConfig(
        model=str(bart_dir), device="cpu", num_kv_blocks=64, engine_process="off", **flags
    )
    with pytest.raises(ModelLoadFailed) as failed:
        build_serving_context(config)
    message = str(failed.value)
    assert "encoder-decoder models do not run with" in message and named in message
    assert "\n" not in message


@pytest.mark.parametrize(("asked", "used"), [("auto", "none"), ("w8a8", "w8a8"), ("int8", "int8")])
def test_an_int8_format_is_used_when_named_and_auto_stays_exact(
    bart_dir: Path, asked: str, used: str
) -> None:
    from server.loading import load_engine

    config = ServerConfig(
        model=str(bart_dir),
        device="cpu",
        num_kv_blocks=64,
        engine_process="off",
        quantization=asked,
    )
    loaded = load_engine(config)
    try:
        assert loaded.runner.quantization == used
    finally:
        loaded.close()


@pytest.mark.parametrize(("asked", "compiled"), [(None, False), (True, True), (False, False)])
def test_the_decode_step_is_compiled_when_asked_for_only(
    bart_dir: Path, asked: bool | None, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its exact float32 default stays eager (a compiled step changes the last bits of sums);
    `--torch-compile` compiles it, under the server's compile cache."""
    import server.runner_setup

    made: list[dict] = []

    class Recorded(server.runner_setup.Seq2SeqRunner):  # type: ignore[misc]
        def __init__(self, model_dir: Path, **options: object) -> None:
            made.append(dict(options))
            options["compile_decode"] = False  # the compile itself: test_seq2seq_compile.py
            super().__init__(model_dir, **options)

    monkeypatch.setattr(server.runner_setup, "Seq2SeqRunner", Recorded)
    config = ServerConfig(
        model=str(bart_dir),
        device="cpu",
        num_kv_blocks=64,
        engine_process="off",
        torch_compile=asked,
        cache_dir=str(bart_dir.parent / "cache"),
    )
    server.runner_setup.build_runner(config, bart_dir, torch.device("cpu"))
    assert made[0]["compile_decode"] is compiled
    assert made[0]["compile_cache"] == bart_dir.parent / "cache" / "compiled"
