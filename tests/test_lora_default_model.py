"""LoRA adapters on the default model (Gemma 3 270M, fp32): greedy and beam search with adapters
of rank 8 and 16 on different projections, mixed with the base in one batch, token-exact against
`generate()` of the base with each adapter merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.model.loader import resolve_model_dir
from tests.conftest import make_engine
from tests.engine_driver import run_to_completion, submit
from tests.lora_adapters import ALL_TARGETS, make_adapter, merged_model

pytestmark = pytest.mark.default_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma_adapters")
    return {
        "attn8": make_adapter(model_dir, root / "attn8", r=8, seed=3, scale=4.0),
        "all16": make_adapter(model_dir, root / "all16", r=16, targets=ALL_TARGETS, seed=4),
    }


def test_adapters_on_the_default_model_equal_generate_of_the_merged_model(
    model_dir: Path, adapters: dict[str, Path]
) -> None:
    engine = make_engine(model_dir, num_blocks=256, block_size=16, max_loras=2)
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    tok = engine.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    greedy = DecodingParams(max_tokens=NEW_TOKENS, temperature=0)
    beams = DecodingParams(max_tokens=6, temperature=0, num_beams=3, n=2)
    jobs = [(ids, name) for ids in prompts for name in (*adapters, None)]
    got = [submit(engine, str(i), ids, greedy, name) for i, (ids, name) in enumerate(jobs)]
    beam = submit(engine, "beam", prompts[0], beams, "all16")
    run_to_completion(engine)
    references = {name: merged_model(model_dir, path) for name, path in adapters.items()}
    from transformers import AutoModelForCausalLM

    references[None] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (ids, name), result in zip(jobs, got):
        with torch.no_grad():
            out = references[name].generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert result.token_ids == out[0, len(ids) :].tolist(), (name, tok.decode(ids))
    by_adapter = {
        name: [r.token_ids for (_, n), r in zip(jobs, got) if n == name] for name in references
    }
    assert by_adapter["attn8"] != by_adapter[None] or by_adapter["all16"] != by_adapter[None]
    with torch.no_grad():
        out = references["all16"].generate(
            torch.tensor([prompts[0]]),
            max_new_tokens=6,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
        )
    expected = [[t for t in o[len(prompts[0]) :].tolist() if t != tok.pad_token_id] for o in out]
    assert [c[1] for c in beam.choices().values()] == expected
    assert engine.pool.num_free == engine.pool.num_blocks
